// GPU tests of streams that come and go (GPUPOOL_RELEASE_UNUSED_STREAMS=1, issue 20), run by
// scripts/gpu.sh once with ordinary segments and once with GPUPOOL_CONF=expandable_segments:True
// (and once more with the high-water rule, GPUPOOL_EXPANDABLE_RECLAIM=1): 1,000 steps, each on a
// stream created for it and destroyed at its end, keep reserved memory flat; every step starts a
// slow reader on its blocks, frees them and destroys the stream while the reader still runs, so
// that the next step's stream, whose growth takes that memory (given back and allocated again,
// or its pages unmapped and mapped again), writes it while the old stream's kernel may still be
// reading: the reader's sums must be those of what was written before the free, bit for bit.
// Built with nvcc against an installed gpupool; prints "N passed, M failed", exits 1 on a
// failure.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gpupool.h"
#include "check.h"

#include "readers.cuh"

int main() {
  const char *conf = getenv("GPUPOOL_CONF");
  printf("GPUPOOL_CONF=%s GPUPOOL_RELEASE_UNUSED_STREAMS=%s GPUPOOL_EXPANDABLE_RECLAIM=%s\n", conf ? conf : "",
         getenv("GPUPOOL_RELEASE_UNUSED_STREAMS") ? getenv("GPUPOOL_RELEASE_UNUSED_STREAMS") : "",
         getenv("GPUPOOL_EXPANDABLE_RECLAIM") ? getenv("GPUPOOL_EXPANDABLE_RECLAIM") : "");
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));
  const int steps = 1000;
  const size_t sizes[] = {64 * MIB, 3 * MIB, 700 << 10, 200 * MIB, 12 * MIB};
  const int nsizes = sizeof sizes / sizeof sizes[0];
  // One counter per step and block, outside gpupool, read at the end.
  unsigned long long *wrong = nullptr;
  CUDA_OK(cudaMalloc((void **)&wrong, sizeof *wrong * steps * nsizes));
  CUDA_OK(cudaMemset(wrong, 0, sizeof *wrong * steps * nsizes));
  long long first = 0, peak = 0;
  for (int step = 0; step < steps; step++) {
    cudaStream_t s;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void *p[nsizes];
    for (int k = 0; k < nsizes; k++) {
      CHECK_OK(gpupool_malloc(&p[k], sizes[k], 0, s));
      uint32_t tag = (uint32_t)(step * nsizes + k);
      fill<<<128, 256, 0, s>>>(static_cast<uint32_t *>(p[k]), sizes[k] / 4, tag);
      // Every tenth step reads slowly (about 2 ms), the others at once.
      long long cycles = step % 10 == 0 ? 4LL * 1000 * 1000 : 0;
      slow_check<<<64, 256, 0, s>>>(static_cast<const uint32_t *>(p[k]), sizes[k] / 4, tag, cycles,
                                   wrong + step * nsizes + k);
    }
    CUDA_OK(cudaGetLastError());
    for (int k = 0; k < nsizes; k++) CHECK_OK(gpupool_free(p[k]));
    CUDA_OK(cudaStreamDestroy(s));
    long long r = stats().reserved_bytes.all.current;
    if (step == 0) first = r;
    if (r > peak) peak = r;
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned long long> host(steps * nsizes);
  CUDA_OK(cudaMemcpy(host.data(), wrong, sizeof *wrong * host.size(), cudaMemcpyDeviceToHost));
  unsigned long long bad = 0;
  for (auto w : host) bad += w;
  CHECK(bad == 0);
  gpupool_stats_t s = stats();
  // The step's own memory, and what a step may add before the scan that follows it.
  CHECK(peak <= 2 * first + (long long)(4 * MIB));
  CHECK(s.reserved_bytes.all.peak <= 2 * first + (long long)(4 * MIB));
  printf("%d steps, a stream each: reserved after the first %lld MiB, peak %lld MiB; segments allocated %lld, freed "
         "%lld; words read wrong by the slow readers: %llu\n",
         steps, first >> 20, (long long)s.reserved_bytes.all.peak >> 20, (long long)s.num_device_alloc,
         (long long)s.num_device_free, bad);
  CUDA_OK(cudaFree(wrong));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(stats().reserved_bytes.all.current == 0);
  return checks_report("test_streams");
}
