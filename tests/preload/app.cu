// app: an ordinary CUDA program that knows nothing of gpupool, for the LD_PRELOAD tests. It
// relies on what cudaFree does: wait for the device. Each round a slow kernel on stream s1
// sums a buffer; the program frees the buffer at once, allocates one of the same size and
// fills it on another stream s2. With the real cudaFree, or the shim's default (safe) rule,
// the new buffer is never the old one while the sum still reads it; an allocator that reused
// it at once would change the sums.
//
//   ./app [rounds]   prints one line per 10 rounds and a checksum; exit 1 on a wrong sum
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA(call)                                                                           \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

__global__ void fill(int *p, size_t n, int v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

// Waits about `spin` clock cycles, then sums p[0..n) into *out.
__global__ void slow_sum(const int *p, size_t n, unsigned long long *out, long long spin) {
  long long start = clock64();
  while (clock64() - start < spin) {
  }
  unsigned long long s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) s += p[i];
  atomicAdd(out, s);
}

int main(int argc, char **argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 60;
  cudaStream_t s1, s2;
  CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  unsigned long long *host;
  CUDA(cudaMallocHost(&host, sizeof *host));
  const size_t sizes[] = {1000, 1 << 16, 300000, 1 << 20, 5000000};
  unsigned long long checksum = 0;
  int wrong = 0;
  for (int r = 0; r < rounds; r++) {
    size_t n = sizes[r % 5];
    int *a, *b;
    unsigned long long *out;
    CUDA(cudaMalloc(&a, n * sizeof(int)));
    CUDA(cudaMalloc(&out, sizeof *out));
    CUDA(cudaMemsetAsync(out, 0, sizeof *out, s1));
    fill<<<256, 256, 0, s1>>>(a, n, r + 1);
    slow_sum<<<64, 256, 0, s1>>>(a, n, out, 2000000);
    CUDA(cudaMemcpyAsync(host, out, sizeof *out, cudaMemcpyDeviceToHost, s1));
    CUDA(cudaFree(a));  // the program counts on this waiting for s1
    CUDA(cudaMalloc(&b, n * sizeof(int)));
    fill<<<256, 256, 0, s2>>>(b, n, -1000);
    CUDA(cudaStreamSynchronize(s1));
    CUDA(cudaStreamSynchronize(s2));
    unsigned long long want = (unsigned long long)n * (unsigned long long)(r + 1);
    if (*host != want) {
      if (wrong < 5) std::fprintf(stderr, "app: round %d: sum %llu, expected %llu\n", r, *host, want);
      wrong++;
    }
    checksum = checksum * 31 + *host;
    CUDA(cudaFree(b));
    CUDA(cudaFree(out));
    if ((r + 1) % 10 == 0) std::printf("app: %d rounds, checksum %llu\n", r + 1, checksum);
  }
  CUDA(cudaFreeHost(host));
  CUDA(cudaStreamDestroy(s1));
  CUDA(cudaStreamDestroy(s2));
  std::printf("app: %d rounds, %d wrong sums\n", rounds, wrong);
  return wrong == 0 ? 0 : 1;
}
