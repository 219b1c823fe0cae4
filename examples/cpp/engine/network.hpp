// network.hpp: the model the example engine serves, and its CPU reference.
//
// A multi-layer perceptron: dense layers with ReLU between them. Every output element is
// computed the same way on the CPU and on the GPU: start from the bias, then one fused
// multiply-add per input in index order (std::fma here, fmaf in the kernel). Both are IEEE
// correctly rounded, so the GPU's results must equal the reference bit for bit; any difference
// means the engine read or wrote memory it should not have (a block reused too early, say).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace engine {

// Layer widths, input first: 4 dense layers.
inline const std::vector<int> &widths() {
  static const std::vector<int> w = {256, 1024, 512, 512, 64};
  return w;
}

// A small deterministic generator (SplitMix64), so that every run and both sides see the same
// weights, requests and batch sizes.
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 23) - 1.0f; }

 private:
  std::uint64_t state_;
};

struct layer {
  int in, out;
  std::vector<float> weight;  // out x in, row-major
  std::vector<float> bias;    // out
};

// A deeper, narrower network with the same input and output widths: `layers` dense layers,
// 128 wide between them. Its kernels are short, so serving it is bound by launching them:
// what CUDA graphs save (engine_graphs' second run).
inline std::vector<int> deep_widths(int layers) {
  std::vector<int> w(static_cast<std::size_t>(layers) + 1, 128);
  w.front() = widths().front();
  w.back() = widths().back();
  return w;
}

inline std::vector<layer> make_network(std::uint64_t seed, const std::vector<int> &w = widths()) {
  rng r(seed);
  std::vector<layer> net;
  for (std::size_t i = 0; i + 1 < w.size(); i++) {
    layer l{w[i], w[i + 1], {}, {}};
    float scale = 1.0f / std::sqrt(static_cast<float>(l.in));
    l.weight.resize(static_cast<std::size_t>(l.in) * l.out);
    for (float &x : l.weight) x = r.uniform() * scale;
    l.bias.resize(l.out);
    for (float &x : l.bias) x = r.uniform() * 0.1f;
    net.push_back(std::move(l));
  }
  return net;
}

// Fills `batch` rows of request `id`'s input.
inline void make_input(std::uint64_t id, int batch, std::vector<float> &x) {
  rng r(0x5eed0000ull + id);
  x.resize(static_cast<std::size_t>(batch) * widths().front());
  for (float &v : x) v = r.uniform();
}

// The batch size of request `id`: 1 to 96 rows, a few large, most small, as requests arrive.
inline int batch_of(std::uint64_t id) {
  rng r(0xba7c0000ull + id);
  std::uint64_t v = r.next();
  return (v % 8 == 0) ? 64 + static_cast<int>(v % 33) : 1 + static_cast<int>((v >> 8) % 24);
}

// The CPU reference, in the kernel's exact order of operations.
inline std::vector<float> reference(const std::vector<layer> &net, const std::vector<float> &input, int batch) {
  std::vector<float> x = input, y;
  for (std::size_t li = 0; li < net.size(); li++) {
    const layer &l = net[li];
    bool relu = li + 1 < net.size();
    y.assign(static_cast<std::size_t>(batch) * l.out, 0.0f);
    for (int b = 0; b < batch; b++) {
      for (int j = 0; j < l.out; j++) {
        float acc = l.bias[j];
        const float *w = &l.weight[static_cast<std::size_t>(j) * l.in];
        const float *xi = &x[static_cast<std::size_t>(b) * l.in];
        for (int k = 0; k < l.in; k++) acc = std::fma(w[k], xi[k], acc);
        y[static_cast<std::size_t>(b) * l.out + j] = relu && acc < 0.0f ? 0.0f : acc;
      }
    }
    x.swap(y);
  }
  return x;
}

}  // namespace engine
