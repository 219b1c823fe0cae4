// Host-side measures of the GPU tests that time copies (test_sleep, test_first_sleep,
// test_peers): seconds since a moment, the pinned copy bandwidth of this run (what a sleep is
// measured against), the process's resident memory. Include after check.h and a definition of
// CUDA_OK.
#ifndef GPUPOOL_TEST_MEASURE_CUH
#define GPUPOOL_TEST_MEASURE_CUH

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdio>

static inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The pinned copy bandwidth of this run, GB/s, one direction, the best of three: `bytes`
// between device memory and cudaHostAlloc memory in 64 MiB pieces on two streams, as gpupool
// copies.
static inline double pinned_bandwidth(size_t bytes, bool to_host) {
  const size_t kPiece = size_t(64) << 20;
  void *dev = nullptr, *host = nullptr;
  if (cudaMalloc(&dev, bytes) != cudaSuccess || cudaHostAlloc(&host, bytes, cudaHostAllocPortable) != cudaSuccess) {
    CHECK(false);
    return 0;
  }
  cudaStream_t st[2];
  for (auto &x : st) CUDA_OK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    auto t = std::chrono::steady_clock::now();
    size_t k = 0;
    for (size_t off = 0; off < bytes; off += kPiece, k++) {
      size_t len = bytes - off < kPiece ? bytes - off : kPiece;
      char *d = static_cast<char *>(dev) + off, *h = static_cast<char *>(host) + off;
      if (to_host)
        CUDA_OK(cudaMemcpyAsync(h, d, len, cudaMemcpyDeviceToHost, st[k % 2]));
      else
        CUDA_OK(cudaMemcpyAsync(d, h, len, cudaMemcpyHostToDevice, st[k % 2]));
    }
    for (auto &x : st) CUDA_OK(cudaStreamSynchronize(x));
    double gbs = (double)bytes / seconds_since(t) / 1e9;
    if (gbs > best) best = gbs;
  }
  for (auto &x : st) CUDA_OK(cudaStreamDestroy(x));
  CUDA_OK(cudaFree(dev));
  CUDA_OK(cudaFreeHost(host));
  return best;
}

// The process's resident host memory (VmRSS of /proc/self/status), MiB; -1 when unreadable.
static inline long long rss_mib() {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long long kib = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %lld kB", &kib) == 1) break;
  fclose(f);
  return kib < 0 ? -1 : kib / 1024;
}

#endif
