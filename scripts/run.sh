#!/usr/bin/env bash
# The main job: build gpupool and run the C example. On a machine with an NVIDIA GPU it runs on
# the GPU; without one it runs on the simulated device and says so. GPUPOOL_DRIVER, if set,
# decides instead.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGPUPOOL_BUILD_TESTS=OFF >/dev/null
cmake --build build -j"$(nproc)"
if [ -z "${GPUPOOL_DRIVER:-}" ]; then
  if nvidia-smi -L >/dev/null 2>&1; then
    export GPUPOOL_DRIVER=cuda
  else
    export GPUPOOL_DRIVER=sim
    echo "run.sh: no NVIDIA GPU found; running on the simulated device (GPUPOOL_DRIVER=sim)"
  fi
fi
echo "run.sh: GPUPOOL_DRIVER=$GPUPOOL_DRIVER"
./build/examples/c/hello
