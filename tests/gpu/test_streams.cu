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

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;

__host__ __device__ inline uint32_t pattern(size_t i, uint32_t tag) { return (uint32_t)(i * 2654435761u) ^ tag; }

__global__ void fill(uint32_t *p, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern(i, tag);
}

// Spins for about `cycles` clock cycles, then counts the words that differ from pattern(., tag):
// a kernel still reading a block after the host freed it and destroyed its stream.
__global__ void slow_check(const uint32_t *p, size_t n, uint32_t tag, long long cycles, unsigned long long *wrong) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    mine += p[i] != pattern(i, tag);
  if (mine) atomicAdd(wrong, mine);
}

static gpupool_stats_t stats() {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s;
}

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
