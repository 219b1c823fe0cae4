/* CUDA(call): a CUDA runtime call of the benchmarks (bench, bench_host), which print where and
 * why it failed (cudaGetErrorString) and exit 1: a benchmark has nothing to measure after. */
#ifndef GPUPOOL_EXAMPLES_CUDA_CHECK_H
#define GPUPOOL_EXAMPLES_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA(call)                                                                           \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

#endif
