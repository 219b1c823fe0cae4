// engine, as built where CMake found no CUDA compiler: the real engine (engine.cu) has kernels
// that only nvcc can build. This stand-in still links gpupool, checks the CPU reference it would
// compare against, and says why it cannot run. Exit status 77: skipped (CTest's convention).
#include <cstdio>

#include "gpupool.hpp"
#include "network.hpp"

int main() {
  const auto net = engine::make_network(42);
  std::vector<float> input;
  engine::make_input(0, engine::batch_of(0), input);
  std::vector<float> out = engine::reference(net, input, engine::batch_of(0));
  std::printf("engine: cannot run: built without a CUDA compiler (CMake found no nvcc), so it has no kernels; "
              "rebuild where the CUDA toolkit is (gpupool %s; CPU reference computed %zu outputs)\n",
              gpupool_version(), out.size());
  return 77;
}
