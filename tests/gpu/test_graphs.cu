// CUDA graphs on a GPU with GPUPOOL_DRIVER=cuda: kernels captured while they allocate from a
// private pool (blocks freed during the capture reused within it), the graph replayed with new
// inputs and its results checked; then a capture broken on purpose by a forbidden call, its pool
// released with blocks still allocated, and the device's free memory back to the byte after
// empty_cache. Built with nvcc against an installed gpupool (scripts/gpu.sh, section graphs).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "gpupool.h"
#include "check.h"

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;

__global__ void scale_into(const float *x, float *y, int n, float a) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * a;
}

__global__ void add_into(const float *x, const float *y, float *z, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) z[i] = x[i] + y[i];
}

static gpupool_stats_t device_stats() {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s;
}

static gpupool_stats_t pool_stats(uint64_t pool) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_pool_stats(0, pool, &s));
  return s;
}

// out = 2x * 3 + x = 7x, through two intermediates allocated from the pool during capture; the
// first is freed before `out` is allocated, so `out` takes its block. Replayed with three
// inputs; every value is an integer under 2^24, so each result is exact.
static void test_capture_and_replay() {
  const int n = 1 << 20;
  const size_t bytes = n * sizeof(float);
  const int threads = 256, blocks = (n + threads - 1) / threads;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *x = nullptr;
  CHECK_OK(gpupool_malloc(&x, bytes, 0, s));  // the graph's input, in the default pools
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create(&pool));
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  void *t1 = nullptr, *t2 = nullptr, *out = nullptr;
  CHECK_OK(gpupool_malloc(&t1, bytes, 0, s));
  scale_into<<<blocks, threads, 0, s>>>(static_cast<float *>(x), static_cast<float *>(t1), n, 2.0f);
  CHECK_OK(gpupool_malloc(&t2, bytes, 0, s));
  scale_into<<<blocks, threads, 0, s>>>(static_cast<float *>(t1), static_cast<float *>(t2), n, 3.0f);
  CHECK_OK(gpupool_free(t1));
  CHECK_OK(gpupool_malloc(&out, bytes, 0, s));
  CHECK(out == t1);  // reused within the capture
  add_into<<<blocks, threads, 0, s>>>(static_cast<float *>(t2), static_cast<float *>(x), static_cast<float *>(out), n);
  CHECK_OK(gpupool_free(t2));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  gpupool_stats_t ps = pool_stats(pool);
  CHECK(ps.allocated_bytes.all.peak == (int64_t)(2 * bytes));
  printf("graphs: captured 3 kernels; pool %llu holds %lld MiB reserved, peak allocated %lld MiB\n",
         (unsigned long long)pool, (long long)(ps.reserved_bytes.all.current >> 20),
         (long long)(ps.allocated_bytes.all.peak >> 20));

  // The graph's segments stay through empty_cache while the pool lives.
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(pool_stats(pool).reserved_bytes.all.current == ps.reserved_bytes.all.current);

  std::vector<float> host(n), back(n);
  int wrong = 0;
  for (int replay = 0; replay < 3; replay++) {
    for (int i = 0; i < n; i++) host[i] = float((i * (replay + 1)) % 100000);
    CUDA_OK(cudaMemcpyAsync(x, host.data(), bytes, cudaMemcpyHostToDevice, s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaMemcpyAsync(back.data(), out, bytes, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i++) wrong += back[i] != host[i] * 7.0f;
  }
  CHECK(wrong == 0);
  printf("graphs: 3 replays, %d of %d results wrong\n", wrong, 3 * n);

  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CHECK_OK(gpupool_free(out));
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK(pool_stats(pool).reserved_bytes.all.current == 0);
  CHECK_OK(gpupool_free(x));
  CUDA_OK(cudaStreamDestroy(s));
}

// A capture broken by a call CUDA forbids during capture (cudaMalloc in global mode): the
// engine's scope releases the pool with blocks still allocated; once they are freed and the
// cache emptied, the device's free memory is what it was, to the byte.
static void test_failed_capture() {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK_OK(gpupool_empty_cache(0));
  CUDA_OK(cudaDeviceSynchronize());
  size_t free_before = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free_before, &total));
  int64_t reserved_before = device_stats().reserved_bytes.all.current;

  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create(&pool));
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  void *a = nullptr, *b = nullptr;
  CHECK_OK(gpupool_malloc(&a, 64 * MIB, 0, s));
  CHECK_OK(gpupool_malloc(&b, 256 * MIB, 0, s));
  scale_into<<<1024, 256, 0, s>>>(static_cast<float *>(a), static_cast<float *>(b), 1 << 18, 2.0f);
  void *forbidden = nullptr;
  CHECK(cudaMalloc(&forbidden, MIB) == cudaErrorStreamCaptureUnsupported);
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(s, &graph) == cudaErrorStreamCaptureInvalidated);
  CHECK(graph == nullptr);
  (void)cudaGetLastError();
  int64_t pool_reserved = pool_stats(pool).reserved_bytes.all.current;
  CHECK(pool_reserved >= (int64_t)(320 * MIB));

  CHECK_OK(gpupool_release_pool(0, pool));  // ends the route too
  CHECK_OK(gpupool_free(a));
  CHECK_OK(gpupool_free(b));
  gpupool_stats_t ps = pool_stats(pool);
  CHECK(ps.reserved_bytes.all.current == 0 && ps.segment.all.current == 0);
  CHECK(device_stats().reserved_bytes.all.current == reserved_before);
  CHECK_OK(gpupool_empty_cache(0));
  CUDA_OK(cudaDeviceSynchronize());
  size_t free_after = 0;
  CUDA_OK(cudaMemGetInfo(&free_after, &total));
  CHECK(free_after == free_before);
  printf("failed capture: pool of %lld MiB released; free memory %zu bytes before, %zu after (difference %lld)\n",
         (long long)(pool_reserved >> 20), free_before, free_after, (long long)free_before - (long long)free_after);
  CUDA_OK(cudaStreamDestroy(s));
}

// A request on a capturing stream that the default pools cannot serve fails with
// GPUPOOL_ERROR_STREAM_CAPTURE, and the capture stays valid.
static void test_default_pool_refused() {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK_OK(gpupool_empty_cache(0));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  void *p = nullptr;
  CHECK(gpupool_malloc(&p, 32 * MIB, 0, s) == GPUPOOL_ERROR_STREAM_CAPTURE);
  printf("default pools during capture: %s\n", gpupool_last_error_message());
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CHECK(graph != nullptr);
  if (graph != nullptr) CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

int main() {
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // create the primary context before measuring free memory
  test_capture_and_replay();
  test_default_pool_refused();
  test_failed_capture();
  return checks_report("test_graphs");
}
