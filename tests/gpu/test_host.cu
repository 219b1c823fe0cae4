// GPU tests of gpupool's pinned host memory (gpupool_host_*) with GPUPOOL_DRIVER=cuda: a block
// freed while a copy from it is still queued must not be handed out again until the copy is
// done; copies from gpupool's blocks are truly asynchronous; a stream of another device; the
// statistics and empty_cache on the real driver. Built with nvcc against an installed gpupool.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "gpupool.h"
#include "check.h"

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// The staging hazard: the copy stream is held busy by a spin kernel, a host-to-device copy
// from a pinned gpupool block is queued behind it, the block is freed (its event recorded),
// and a new block of the same size is allocated and overwritten at once. Were the freed block
// handed out again, the queued copy would read the new bytes; the device must get the
// original ones.
static void test_in_flight_copy_keeps_its_block() {
  const size_t n = 4 * MIB;
  cudaStream_t copy;
  CUDA_OK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  void *dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, n));
  unsigned char *a = nullptr, *b = nullptr;
  CHECK_OK(gpupool_host_malloc((void **)&a, n));
  if (!a || !dev) return;
  memset(a, 0xA1, n);
  spin<<<1, 1, 0, copy>>>(2000LL * 1000 * 1000);  // about a second at 2 GHz
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpyAsync(dev, a, n, cudaMemcpyHostToDevice, copy));
  CHECK_OK(gpupool_host_record_event(a, copy));
  CHECK_OK(gpupool_host_free(a));
  CHECK_OK(gpupool_host_malloc((void **)&b, n));
  CHECK(b != a);
  if (b) memset(b, 0xB2, n);
  // The copy had not run yet when the block was replaced: the race was real.
  CHECK(cudaStreamQuery(copy) == cudaErrorNotReady);
  CUDA_OK(cudaStreamSynchronize(copy));
  std::vector<unsigned char> back(n);
  CUDA_OK(cudaMemcpy(back.data(), dev, n, cudaMemcpyDeviceToHost));
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += back[i] != 0xA1;
  CHECK(wrong == 0);
  // The copy is done: the next allocation of the size takes a again.
  unsigned char *c = nullptr;
  CHECK_OK(gpupool_host_malloc((void **)&c, n));
  CHECK(c == a);
  CHECK_OK(gpupool_host_free(b));
  CHECK_OK(gpupool_host_free(c));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaStreamDestroy(copy));
  printf("in-flight copy: block held back while the copy was queued (%p != %p), %zu wrong bytes, reused after (%p)\n",
         (void *)b, (void *)a, wrong, (void *)c);
}

// A copy from gpupool's pinned memory returns before the busy stream runs it (asynchronous);
// the runtime sees the memory as pinned host memory.
static void test_copies_are_asynchronous() {
  const size_t n = 16 * MIB;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *dev = nullptr, *h = nullptr;
  CUDA_OK(cudaMalloc(&dev, n));
  CHECK_OK(gpupool_host_malloc(&h, n));
  cudaPointerAttributes attr;
  CUDA_OK(cudaPointerGetAttributes(&attr, h));
  CHECK(attr.type == cudaMemoryTypeHost);
  spin<<<1, 1, 0, s>>>(1000LL * 1000 * 1000);
  CUDA_OK(cudaMemcpyAsync(dev, h, n, cudaMemcpyHostToDevice, s));
  CHECK(cudaStreamQuery(s) == cudaErrorNotReady);  // the call returned before the copy ran
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK_OK(gpupool_host_free(h));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaStreamDestroy(s));
  printf("asynchronous: cudaMemcpyAsync from a gpupool block returned before the copy ran\n");
}

// A stream of another device: the event goes to that device's context (found from the
// stream), and the block is held back until that stream passes the free.
static void test_other_device_stream() {
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  if (count < 2) {
    printf("other device: skipped (one device)\n");
    return;
  }
  CUDA_OK(cudaSetDevice(1));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, MIB));
  CUDA_OK(cudaSetDevice(0));  // the thread's current device is not the stream's
  void *a = nullptr, *b = nullptr;
  CHECK_OK(gpupool_host_malloc(&a, MIB));
  CUDA_OK(cudaSetDevice(1));
  spin<<<1, 1, 0, s>>>(1000LL * 1000 * 1000);
  CUDA_OK(cudaMemcpyAsync(dev, a, MIB, cudaMemcpyHostToDevice, s));
  CUDA_OK(cudaSetDevice(0));
  CHECK_OK(gpupool_host_record_event(a, s));
  CHECK_OK(gpupool_host_free(a));
  CHECK_OK(gpupool_host_malloc(&b, MIB));
  CHECK(b != a);
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaSetDevice(0));
  CHECK_OK(gpupool_host_free(b));
  printf("other device: the event went to device 1's stream\n");
}

// Statistics and empty_cache on the real driver: a hit costs no cudaHostAlloc, empty_cache
// gives everything back.
static void test_stats_and_empty_cache() {
  CHECK_OK(gpupool_host_empty_cache());
  gpupool_host_stats_t s0 = GPUPOOL_HOST_STATS_INIT;
  CHECK_OK(gpupool_host_stats(&s0));
  void *p = nullptr;
  for (int i = 0; i < 100; i++) {
    CHECK_OK(gpupool_host_malloc(&p, 3 * MIB));
    CHECK_OK(gpupool_host_free(p));
  }
  gpupool_host_stats_t s1 = GPUPOOL_HOST_STATS_INIT;
  CHECK_OK(gpupool_host_stats(&s1));
  // One cuMemHostAlloc and 99 hits. 3 MiB is a size class of its own (above 1 MiB, 32 classes
  // per power of two: src/host/classes.rs), so the block is 3 MiB, where PyTorch pins 4 MiB.
  CHECK(s1.num_host_alloc == s0.num_host_alloc + 1);
  CHECK(s1.allocated_bytes.current == s0.allocated_bytes.current + 3 * (long long)MIB);
  CHECK_OK(gpupool_host_empty_cache());
  gpupool_host_stats_t s2 = GPUPOOL_HOST_STATS_INIT;
  CHECK_OK(gpupool_host_stats(&s2));
  CHECK(s2.allocations.current == 0 && s2.num_host_free == s2.num_host_alloc);
  printf("stats: cuMemHostAlloc took %lld us, cuMemFreeHost %lld us (mean)\n",
         (long long)(s2.host_alloc_time.count ? s2.host_alloc_time.total / s2.host_alloc_time.count : 0),
         (long long)(s2.host_free_time.count ? s2.host_free_time.total / s2.host_free_time.count : 0));
}

int main() {
  test_in_flight_copy_keeps_its_block();
  test_copies_are_asynchronous();
  test_other_device_stream();
  test_stats_and_empty_cache();
  return checks_report("test_host (GPU)");
}
