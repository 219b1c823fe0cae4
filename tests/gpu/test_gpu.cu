// GPU tests of gpupool with GPUPOOL_DRIVER=cuda, beside what the simulated device checks:
// cross-stream safety, runtime-API interop, out-of-memory on the real device and its observers,
// memory given back, and the device argument. Built with nvcc against an installed gpupool.
#include <cuda_runtime.h>

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

__global__ void scale(float *x, int n, float a) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}

static gpupool_stats_t stats() {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s;
}

// A block used on a busy stream B and freed is not handed to the allocating stream A until B
// has passed the point of the free, and is handed back once it has.
static void test_cross_stream() {
  cudaStream_t a, b;
  CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  void *p = nullptr, *q = nullptr, *r = nullptr;
  CHECK_OK(gpupool_malloc(&p, 4 * MIB, 0, a));
  spin<<<1, 1, 0, b>>>(2000LL * 1000 * 1000);  // about a second at 2 GHz
  CUDA_OK(cudaGetLastError());
  CHECK_OK(gpupool_record_stream(p, b));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_malloc(&q, 4 * MIB, 0, a));
  CHECK(q != p);
  CHECK(cudaStreamQuery(b) == cudaErrorNotReady);  // the test really raced the busy stream
  CHECK_OK(gpupool_free(q));
  CUDA_OK(cudaStreamSynchronize(b));
  CHECK_OK(gpupool_malloc(&r, 4 * MIB, 0, a));
  CHECK(r == p);
  CHECK_OK(gpupool_free(r));
  CUDA_OK(cudaStreamDestroy(a));
  CUDA_OK(cudaStreamDestroy(b));
  printf("cross-stream: held back while busy (%p != %p), returned after (%p)\n", q, p, r);
}

// gpupool memory used by cudaMemcpyAsync and a kernel, results checked.
static void test_interop() {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int n = 1 << 20;
  std::vector<float> host(n), back(n);
  for (int i = 0; i < n; i++) host[i] = float(i % 1000) * 0.5f;
  void *d = nullptr;
  CHECK_OK(gpupool_malloc(&d, n * sizeof(float), 0, s));
  CUDA_OK(cudaMemcpyAsync(d, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
  scale<<<(n + 255) / 256, 256, 0, s>>>(static_cast<float *>(d), n, 2.0f);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpyAsync(back.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaStreamSynchronize(s));
  int wrong = 0;
  for (int i = 0; i < n; i++) wrong += back[i] != host[i] * 2.0f;
  CHECK(wrong == 0);
  CHECK_OK(gpupool_free(d));
  CUDA_OK(cudaStreamDestroy(s));
  printf("interop: %d of %d floats wrong\n", wrong, n);
}

// Fill the device through gpupool, free everything (cached), then ask for a larger size on
// another stream: only the release-and-retry path can serve it (the cached blocks are the first
// stream's; with expandable segments, the default, they are free pages of its range, which
// would serve a request on the same stream without a retry).
static void test_out_of_memory() {
  std::vector<void *> blocks;
  const size_t chunk = size_t(1) << 30;
  for (;;) {
    void *p = nullptr;
    if (gpupool_malloc(&p, chunk, 0, nullptr) != GPUPOOL_SUCCESS) break;
    blocks.push_back(p);
  }
  gpupool_stats_t full = stats();
  printf("out-of-memory: filled %zu GiB in 1 GiB blocks; reserved %lld MiB\n", blocks.size(),
         (long long)(full.reserved_bytes.all.current >> 20));
  CHECK(blocks.size() > 4);
  for (void *p : blocks) CHECK_OK(gpupool_free(p));
  int64_t retries = stats().num_alloc_retries;
  cudaStream_t other;
  CUDA_OK(cudaStreamCreate(&other));
  void *big = nullptr;
  CHECK_OK(gpupool_malloc(&big, 2 * chunk, 0, other));
  gpupool_stats_t s = stats();
  CHECK(s.num_alloc_retries > retries);
  printf("out-of-memory: 2 GiB after the fill served by release-and-retry (num_alloc_retries %lld -> %lld)\n",
         (long long)retries, (long long)s.num_alloc_retries);
  CHECK_OK(gpupool_free(big));
  CHECK_OK(gpupool_empty_cache(0));
  CUDA_OK(cudaStreamDestroy(other));
  void *impossible = nullptr;
  CHECK(gpupool_malloc(&impossible, size_t(1) << 50, 0, nullptr) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  printf("out-of-memory: %s\n", gpupool_last_error_message());
  CHECK(strncmp(gpupool_last_error_message(), "gpupool_malloc: CUDA out of memory. Tried to allocate", 53) == 0);
}

// What the out-of-memory observer saw, and what it is to do: free `spare` if set, and ask for
// a retry if `retry` is.
struct OomSeen {
  int calls = 0;
  int device = -1;
  size_t requested = 0;
  int64_t num_ooms = -1;
  void *spare = nullptr;
  bool retry = false;
};

static void oom_observer(int device, size_t requested, const gpupool_stats_t *stats, void *user) {
  OomSeen *seen = static_cast<OomSeen *>(user);
  seen->calls++;
  seen->device = device;
  seen->requested = requested;
  seen->num_ooms = stats->num_ooms;
  if (seen->spare != nullptr) {
    CHECK_OK(gpupool_free(seen->spare));  // no lock of gpupool's is held here
    seen->spare = nullptr;
  }
  if (seen->retry) CHECK_OK(gpupool_oom_retry());
}

// An out-of-memory observer on the real device: called once when a request for more than the
// device's capacity fails, with the device, the size asked and num_ooms counting the failure;
// then, with 60% of the free memory held, a second request of that size fails until the
// observer frees the held block and asks for a retry, which the freed block serves.
static void test_oom_observer() {
  CHECK_OK(gpupool_empty_cache(0));
  size_t free_mem = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free_mem, &total));
  OomSeen seen;
  CHECK_OK(gpupool_attach_oom_observer(oom_observer, &seen));
  int64_t before = stats().num_ooms;
  const size_t too_big = total + MIB;
  void *p = nullptr;
  CHECK(gpupool_malloc(&p, too_big, 0, nullptr) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(p == nullptr);
  CHECK(seen.calls == 1 && seen.device == 0 && seen.requested == too_big);
  CHECK(seen.num_ooms == before + 1);
  CHECK(strstr(gpupool_last_error_message(), "Largest free block over all streams") != nullptr);
  printf("oom observer: called %d time(s) for %zu bytes on device %d (num_ooms %lld)\n", seen.calls,
         seen.requested, seen.device, (long long)seen.num_ooms);

  const size_t held = free_mem / 10 * 6;
  void *hold = nullptr, *q = nullptr;
  CHECK_OK(gpupool_malloc(&hold, held, 0, nullptr));
  seen.spare = hold;
  seen.retry = true;
  CHECK_OK(gpupool_malloc(&q, held, 0, nullptr));
  CHECK(q == hold);
  CHECK(seen.calls == 2 && seen.num_ooms == before + 2 && seen.spare == nullptr);
  printf("oom observer: freed %zu MiB and asked for a retry, which served the request (%p)\n", held >> 20, q);
  CHECK_OK(gpupool_free(q));
  CHECK_OK(gpupool_detach_oom_observer(oom_observer, &seen));
  CHECK(gpupool_malloc(&p, too_big, 0, nullptr) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(seen.calls == 2);  // detached
  CHECK_OK(gpupool_empty_cache(0));
}

static void test_devices() {
  int count = 0;
  CHECK_OK(gpupool_device_count(&count));
  int cuda_count = 0;
  CUDA_OK(cudaGetDeviceCount(&cuda_count));
  CHECK(count == cuda_count);
  CUDA_OK(cudaSetDevice(count - 1));
  void *p = nullptr;
  CHECK_OK(gpupool_malloc(&p, MIB, -1, nullptr));
  cudaPointerAttributes attr;
  CUDA_OK(cudaPointerGetAttributes(&attr, p));
  CHECK(attr.device == count - 1 && attr.type == cudaMemoryTypeDevice);
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_malloc(&p, MIB, 0, nullptr));
  CHECK_OK(gpupool_free(p));
  CHECK(gpupool_malloc(&p, MIB, count, nullptr) == GPUPOOL_ERROR_INVALID_VALUE);
  printf("devices: %d; -1, 0 and %d (out of range: %s)\n", count, count, gpupool_last_error_message());
  CUDA_OK(cudaSetDevice(0));
}

int main() {
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // create the primary context before measuring free memory
  size_t free_start = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free_start, &total));
  test_devices();
  test_cross_stream();
  test_interop();
  test_out_of_memory();
  test_oom_observer();
  CHECK_OK(gpupool_empty_cache(-1));
  size_t free_end = 0;
  CUDA_OK(cudaMemGetInfo(&free_end, &total));
  gpupool_stats_t s = stats();
  CHECK(s.reserved_bytes.all.current == 0);
  long long diff = (long long)free_start - (long long)free_end;
  CHECK(diff <= (long long)(8 * MIB));
  printf("given back: free memory %zu MiB at start, %zu MiB after empty_cache (difference %lld bytes)\n",
         free_start >> 20, free_end >> 20, diff);
  return checks_report("test_gpu");
}
