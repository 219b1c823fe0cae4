// Kernels and helpers shared by the GPU tests of memory that moves while a kernel may still
// read it (test_streams, test_rule_wait): a fill with a pattern per tag, and a slow reader that
// spins, then counts the words that differ from the pattern. Include after gpupool.h and
// check.h.
#ifndef GPUPOOL_TEST_READERS_CUH
#define GPUPOOL_TEST_READERS_CUH

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;

__host__ __device__ inline uint32_t pattern(size_t i, uint32_t tag) { return (uint32_t)(i * 2654435761u) ^ tag; }

__global__ void fill(uint32_t *p, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern(i, tag);
}

// Spins for about `cycles` clock cycles, then adds to `*wrong` the words of `p` that differ from
// pattern(., tag): a kernel still reading a block after the host freed it.
__global__ void slow_check(const uint32_t *p, size_t n, uint32_t tag, long long cycles, unsigned long long *wrong) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    mine += p[i] != pattern(i, tag);
  if (mine) atomicAdd(wrong, mine);
}

// Device 0's statistics.
static gpupool_stats_t stats() {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s;
}

#endif
