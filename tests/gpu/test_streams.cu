// GPU tests of streams that come and go (GPUPOOL_RELEASE_UNUSED_STREAMS=1, issue 20), run by
// scripts/gpu.sh once with ordinary segments and once with GPUPOOL_CONF=expandable_segments:True
// (and once more with the high-water rule, GPUPOOL_EXPANDABLE_RECLAIM=1):
//   1. 1,000 steps, each on a stream created for it, keep reserved memory flat: every step
//      starts a slow reader on its blocks and frees them while the reader still runs, so that
//      a later step's stream, whose growth takes that memory (given back and allocated again,
//      or its pages unmapped and mapped again), writes it while the old stream's kernel may
//      still be reading: the reader's sums must be those of what was written before the free,
//      bit for bit. The streams live to the end: CUDA gives a destroyed stream's handle to the
//      next stream created, which would make every step's stream the same to gpupool;
//   2. 200 steps that destroy their stream at the step's end, the reader still running, after
//      gpupool_stream_retire: the next stream gets the same handle (the count of distinct
//      handles is printed), and gpupool's blocks freed on the old one are reused by it only
//      once the old work is done. Without the retire, two H200s read 40% of the words wrong.
// Built with nvcc against an installed gpupool; prints "N passed, M failed", exits 1 on a
// failure.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#include "gpupool.h"
#include "check.h"

#include "readers.cuh"

static const size_t kSizes[] = {64 * MIB, 3 * MIB, 700 << 10, 200 * MIB, 12 * MIB};
static const int kBlocks = sizeof kSizes / sizeof kSizes[0];

// One step on `s`: the blocks allocated, filled, read by a reader (slow every tenth step),
// freed. `wrong` has a counter per block of the step.
static void step(cudaStream_t s, int n, unsigned long long *wrong) {
  void *p[kBlocks];
  for (int k = 0; k < kBlocks; k++) {
    CHECK_OK(gpupool_malloc(&p[k], kSizes[k], 0, s));
    uint32_t tag = (uint32_t)(n * kBlocks + k);
    fill<<<128, 256, 0, s>>>(static_cast<uint32_t *>(p[k]), kSizes[k] / 4, tag);
    long long cycles = n % 10 == 0 ? 4LL * 1000 * 1000 : 0;  // about 2 ms
    slow_check<<<64, 256, 0, s>>>(static_cast<const uint32_t *>(p[k]), kSizes[k] / 4, tag, cycles, wrong + k);
  }
  CUDA_OK(cudaGetLastError());
  for (int k = 0; k < kBlocks; k++) CHECK_OK(gpupool_free(p[k]));
}

// The words read wrong over `steps` steps' counters, the first ten blocks that had some
// printed (for a failure's report).
static unsigned long long read_wrong(const unsigned long long *wrong, int steps, const char *part) {
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<unsigned long long> host((size_t)steps * kBlocks);
  CUDA_OK(cudaMemcpy(host.data(), wrong, sizeof *wrong * host.size(), cudaMemcpyDeviceToHost));
  unsigned long long bad = 0, blocks_bad = 0;
  for (size_t i = 0; i < host.size(); i++) {
    bad += host[i];
    if (host[i] && blocks_bad++ < 10)
      printf("%s: step %zu, block %zu (%zu bytes): %llu words wrong\n", part, i / kBlocks, i % kBlocks,
             kSizes[i % kBlocks], host[i]);
  }
  if (blocks_bad) printf("%s: %llu of %zu blocks read wrong\n", part, blocks_bad, host.size());
  return bad;
}

int main() {
  const char *conf = getenv("GPUPOOL_CONF");
  printf("GPUPOOL_CONF=%s GPUPOOL_RELEASE_UNUSED_STREAMS=%s GPUPOOL_EXPANDABLE_RECLAIM=%s\n", conf ? conf : "",
         getenv("GPUPOOL_RELEASE_UNUSED_STREAMS") ? getenv("GPUPOOL_RELEASE_UNUSED_STREAMS") : "",
         getenv("GPUPOOL_EXPANDABLE_RECLAIM") ? getenv("GPUPOOL_EXPANDABLE_RECLAIM") : "");
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));
  const int steps = 1000, destroyed_steps = 200;
  // One counter per step and block, outside gpupool, read at the end of each part.
  unsigned long long *wrong = nullptr;
  CUDA_OK(cudaMalloc((void **)&wrong, sizeof *wrong * steps * kBlocks));
  CUDA_OK(cudaMemset(wrong, 0, sizeof *wrong * steps * kBlocks));

  // 1. A stream a step, each kept to the end.
  long long first = 0, peak = 0;
  std::vector<cudaStream_t> kept(steps);
  for (int n = 0; n < steps; n++) {
    CUDA_OK(cudaStreamCreateWithFlags(&kept[n], cudaStreamNonBlocking));
    step(kept[n], n, wrong + n * kBlocks);
    long long r = stats().reserved_bytes.all.current;
    if (n == 0) first = r;
    if (r > peak) peak = r;
  }
  unsigned long long bad = read_wrong(wrong, steps, "streams kept");
  CHECK(bad == 0);
  gpupool_stats_t s = stats();
  // The step's own memory, and what a step may add before the scan that follows it.
  CHECK(peak <= 2 * first + (long long)(4 * MIB));
  CHECK(s.reserved_bytes.all.peak <= 2 * first + (long long)(4 * MIB));
  printf("%d steps, a stream each: reserved after the first %lld MiB, peak %lld MiB; segments allocated %lld, freed "
         "%lld; words read wrong by the slow readers: %llu\n",
         steps, first >> 20, (long long)s.reserved_bytes.all.peak >> 20, (long long)s.num_device_alloc,
         (long long)s.num_device_free, bad);
  for (int k = 0; k < 2; k++) {
    // A stream gpupool holds nothing of any more (its blocks freed, its cache released or not)
    // may still be waited for; one it never served is not.
    int waited = -1;
    CHECK_OK(gpupool_stream_retire(0, kept[k], &waited));
    CHECK(waited == 0 || waited == 1);
  }
  for (cudaStream_t x : kept) CUDA_OK(cudaStreamDestroy(x));

  // 2. A stream a step, destroyed at the step's end after gpupool_stream_retire.
  CUDA_OK(cudaMemset(wrong, 0, sizeof *wrong * steps * kBlocks));
  std::set<cudaStream_t> handles;
  int waits = 0;
  for (int n = 0; n < destroyed_steps; n++) {
    cudaStream_t x;
    CUDA_OK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
    handles.insert(x);
    step(x, n, wrong + n * kBlocks);
    int waited = 0;
    CHECK_OK(gpupool_stream_retire(0, x, &waited));
    waits += waited;
    CUDA_OK(cudaStreamDestroy(x));
  }
  bad = read_wrong(wrong, destroyed_steps, "streams destroyed");
  CHECK(bad == 0);
  CHECK(waits == destroyed_steps);
  printf("%d steps, a stream each destroyed after gpupool_stream_retire: %zu distinct handles, %d waits; words read "
         "wrong by the slow readers: %llu\n",
         destroyed_steps, handles.size(), waits, bad);
  int none = -1;
  CHECK(gpupool_stream_retire(0, nullptr, &none) == GPUPOOL_ERROR_INVALID_VALUE && none == -1);

  CUDA_OK(cudaFree(wrong));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(stats().reserved_bytes.all.current == 0);
  return checks_report("test_streams");
}
