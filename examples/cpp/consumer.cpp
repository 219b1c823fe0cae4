// A C++ program that uses gpupool through find_package(gpupool) and the RAII wrapper: buffers
// move between owners, free themselves, and errors arrive as exceptions.
#include <cstdio>
#include <vector>

#include "gpupool.hpp"

int main() {
  try {
    std::vector<gpupool::buffer> layers;
    for (std::size_t mib : {1, 2, 4, 8}) layers.emplace_back(mib << 20, nullptr);
    gpupool::buffer moved = std::move(layers.back());
    layers.pop_back();
    auto s = gpupool::stats();
    std::printf("consumer: %lld live blocks, %lld bytes allocated, %lld reserved\n",
                static_cast<long long>(s.allocation.all.current),
                static_cast<long long>(s.allocated_bytes.all.current),
                static_cast<long long>(s.reserved_bytes.all.current));
    if (s.allocation.all.current != 4) return 1;
    layers.clear();
    moved.reset();
    try {
      gpupool::buffer too_big(std::size_t(1) << 52, nullptr);
      return 1;
    } catch (const gpupool::error &e) {
      std::printf("consumer: expected failure: %s\n", e.what());
      if (e.status() != GPUPOOL_ERROR_OUT_OF_MEMORY) return 1;
    }
    gpupool::empty_cache();
    s = gpupool::stats();
    std::printf("consumer: after empty_cache, reserved %lld bytes\n", static_cast<long long>(s.reserved_bytes.all.current));
    return s.reserved_bytes.all.current == 0 ? 0 : 1;
  } catch (const gpupool::error &e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
