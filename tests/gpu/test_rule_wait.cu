// GPU test of what the high-water rule (GPUPOOL_EXPANDABLE_RECLAIM=1 with expandable segments)
// waits for before it unmaps the growing stream's own free pages: an event recorded on that
// stream, not a device synchronisation. Stream B spins for seconds; on stream A a slow reader
// checks a block, the block is freed, and a larger request on A grows past the high-water mark,
// so the rule unmaps the freed block's pages and maps them where A grows. The reader must see
// the block's words bit for bit (an unmapping under it would be an illegal address, which
// poisons the context), and the growth must return while B's kernel still spins (a device
// synchronisation would have waited for it). The test sets its configuration itself.
// Built with nvcc against an installed gpupool; prints "N passed, M failed", exits 1 on a
// failure.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "gpupool.h"
#include "check.h"

#include "readers.cuh"

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

int main() {
  setenv("GPUPOOL_CONF", "expandable_segments:True", 1);
  setenv("GPUPOOL_EXPANDABLE_RECLAIM", "1", 1);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));
  int khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  const long long ms = (long long)khz;  // clock cycles per millisecond
  cudaStream_t a, b;
  CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  unsigned long long *wrong = nullptr;
  CUDA_OK(cudaMalloc((void **)&wrong, sizeof *wrong));
  CUDA_OK(cudaMemset(wrong, 0, sizeof *wrong));
  // Each kernel once before anything is timed: loading a module lazily (CUDA's default) waits
  // for the kernels running, which would look like the growth waiting for B, and takes device
  // memory, which would look like memory not given back.
  fill<<<1, 1, 0, a>>>(static_cast<uint32_t *>(nullptr), 0, 0);
  spin<<<1, 1, 0, a>>>(0);
  slow_check<<<1, 1, 0, a>>>(nullptr, 0, 0, 0, wrong);
  CUDA_OK(cudaDeviceSynchronize());
  size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));

  // 20 MiB and 20 MiB on A: the device's mark is 40 MiB.
  void *x = nullptr, *y = nullptr, *z = nullptr;
  CHECK_OK(gpupool_malloc(&x, 20 * MIB, 0, a));
  CHECK_OK(gpupool_malloc(&y, 20 * MIB, 0, a));
  const uint32_t tag = 0x5eed;
  fill<<<128, 256, 0, a>>>(static_cast<uint32_t *>(x), 20 * MIB / 4, tag);
  // B spins for 3 s; A reads x after 300 ms, then frees it in stream order.
  cudaEvent_t b_done;
  CUDA_OK(cudaEventCreateWithFlags(&b_done, cudaEventDisableTiming));
  spin<<<1, 1, 0, b>>>(3000 * ms);
  CUDA_OK(cudaEventRecord(b_done, b));
  slow_check<<<64, 256, 0, a>>>(static_cast<const uint32_t *>(x), 20 * MIB / 4, tag, 300 * ms, wrong);
  CUDA_OK(cudaGetLastError());
  CHECK_OK(gpupool_free(x));
  // 40 MiB do not fit x's 20 MiB: A's segment grows past the mark, and the rule first unmaps
  // x's pages, after A's reader ran, for the growth to map.
  auto t0 = std::chrono::steady_clock::now();
  CHECK_OK(gpupool_malloc(&z, 40 * MIB, 0, a));
  double growth_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  cudaError_t b_state = cudaEventQuery(b_done);
  CHECK(b_state == cudaErrorNotReady);  // the growth did not wait for B
  CHECK(cudaStreamQuery(a) == cudaSuccess);  // it waited for A's reader
  gpupool_stats_t s = stats();
  CHECK(s.reserved_bytes.all.peak == (long long)(60 * MIB));  // x's pages moved, 20 MiB made
  fill<<<128, 256, 0, a>>>(static_cast<uint32_t *>(z), 40 * MIB / 4, tag + 1);
  CUDA_OK(cudaDeviceSynchronize());
  unsigned long long bad = ~0ull;
  CUDA_OK(cudaMemcpy(&bad, wrong, sizeof bad, cudaMemcpyDeviceToHost));
  CHECK(bad == 0);
  printf("rule wait: growth returned after %.1f ms with B %s and A done; %llu wrong words; peak reserved %lld MiB\n",
         growth_ms, b_state == cudaErrorNotReady ? "still spinning" : "done", bad,
         (long long)(s.reserved_bytes.all.peak / (long long)MIB));

  CHECK_OK(gpupool_free(y));
  CHECK_OK(gpupool_free(z));
  CHECK_OK(gpupool_empty_cache(0));
  size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  CHECK(free1 == free0);  // empty_cache gives every page back
  printf("rule wait: free memory %zu before, %zu after empty_cache\n", free0, free1);
  CUDA_OK(cudaFree(wrong));
  CUDA_OK(cudaEventDestroy(b_done));
  CUDA_OK(cudaStreamDestroy(a));
  CUDA_OK(cudaStreamDestroy(b));
  return checks_report("test_rule_wait (GPU)");
}
