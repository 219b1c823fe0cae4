// common.cuh: what the eager engine (engine.cu) and the graph engine (graphs.cu) share: the
// one kernel, the network's weights on the device, and error checks.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "gpupool.hpp"
#include "network.hpp"

inline void cuda_check(cudaError_t e, const char *call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}
#define CUDA(call) cuda_check((call), #call)

// One output element per thread: y[b, j] = act(bias[j] + sum_k w[j, k] * x[b, k]), the sum as
// fused multiply-adds in index order, exactly as engine::reference computes it.
__global__ void dense(const float *__restrict__ w, const float *__restrict__ bias, const float *__restrict__ x,
                      float *__restrict__ y, int in, int out, int relu) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  int b = blockIdx.y;
  if (j >= out) return;
  const float *wr = w + static_cast<size_t>(j) * in;
  const float *xr = x + static_cast<size_t>(b) * in;
  float acc = bias[j];
  for (int k = 0; k < in; k++) acc = fmaf(wr[k], xr[k], acc);
  y[static_cast<size_t>(b) * out + j] = (relu && acc < 0.0f) ? 0.0f : acc;
}

struct device_layer {
  int in, out;
  gpupool::buffer weight, bias;
};

// The network's weights in gpupool blocks allocated for `stream`, which reads them.
inline std::vector<device_layer> upload(const std::vector<engine::layer> &net, cudaStream_t stream) {
  std::vector<device_layer> layers;
  for (const auto &l : net) {
    device_layer d{l.in, l.out, gpupool::buffer(l.weight.size() * sizeof(float), stream),
                   gpupool::buffer(l.bias.size() * sizeof(float), stream)};
    CUDA(cudaMemcpy(d.weight.get(), l.weight.data(), l.weight.size() * sizeof(float), cudaMemcpyHostToDevice));
    CUDA(cudaMemcpy(d.bias.get(), l.bias.data(), l.bias.size() * sizeof(float), cudaMemcpyHostToDevice));
    layers.push_back(std::move(d));
  }
  return layers;
}
