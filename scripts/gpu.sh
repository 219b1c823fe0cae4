#!/usr/bin/env bash
# gpupool on a GPU, in two steps, because the GPU machine has CUDA, CMake and PyTorch but no
# Rust toolchain.
#
#   scripts/gpu.sh prepare [DIR]   where cargo is: build, install gpupool into DIR/prefix, copy
#                                  the Rust test binaries to DIR/bin and the traces to DIR/traces
#                                  (DIR defaults to .device, which git ignores)
#   scripts/gpu.sh run [DIR] [OUT] on the GPU machine: build the C tests, the GPU tests and the
#                                  examples against DIR/prefix, run every test with
#                                  GPUPOOL_DRIVER=cuda (the Rust tests run on the simulated
#                                  device there too), then the examples and the benchmark; logs
#                                  go to OUT (default DIR/out)
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
dir=${2:-.device}

if [ "$step" = prepare ]; then
  source scripts/deps.sh
  rm -rf "$dir/prefix" "$dir/bin" "$dir/traces"
  mkdir -p "$dir/bin" "$dir/traces"
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build -j"$(nproc)"
  cmake --install build --prefix "$dir/prefix" >/dev/null
  cargo test --release --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | while read -r exe; do cp "$exe" "$dir/bin/"; done
  # Stripped, to travel light (the GPU machine takes at most 64 MiB).
  strip "$dir"/bin/*
  strip --strip-debug "$dir/prefix/lib/libgpupool.a" "$dir/prefix/lib/libgpupool.so"
  shared=../shared/traces
  if [ -d "$shared" ]; then cp "$shared"/*.txt.gz "$dir/traces/"; fi
  du -sh "$dir"
  exit 0
fi

if [ "$step" != run ]; then
  echo "usage: scripts/gpu.sh prepare|run [DIR] [OUT]" >&2
  exit 2
fi
out=${3:-$dir/out}
mkdir -p "$out"
prefix=$(cd "$dir/prefix" && pwd)
export GPUPOOL_DRIVER=cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
status=0

echo "== Rust tests (simulated device)"
for t in "$dir"/bin/*; do "$t" --quiet >>"$out/rust-tests.log" 2>&1 || status=1; done
grep -E "test result" "$out/rust-tests.log" || true

echo "== C tests with GPUPOOL_DRIVER=cuda"
cmake -S tests/c -B build-gpu/c -DCMAKE_PREFIX_PATH="$prefix" -DGPUPOOL_TEST_DRIVER=cuda >"$out/c-tests.log" 2>&1
cmake --build build-gpu/c -j >>"$out/c-tests.log" 2>&1
ctest --test-dir build-gpu/c --output-on-failure -E c_no_driver >>"$out/c-tests.log" 2>&1 || status=1
grep -E "tests passed|Failed|passed," "$out/c-tests.log" || true

echo "== GPU tests"
cmake -S tests/gpu -B build-gpu/gpu -DCMAKE_PREFIX_PATH="$prefix" >"$out/gpu-tests.log" 2>&1
cmake --build build-gpu/gpu -j >>"$out/gpu-tests.log" 2>&1
./build-gpu/gpu/test_gpu 2>&1 | tee -a "$out/gpu-tests.log" || status=1

echo "== examples"
torch_dir=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
if ! { cmake -S examples/c -B build-gpu/examples -DCMAKE_PREFIX_PATH="$prefix" -DGPUPOOL_TORCH_DIR="$torch_dir" &&
       cmake --build build-gpu/examples -j; } >"$out/examples-build.log" 2>&1; then
  echo "bench with PyTorch did not build (see examples-build.log); building it without"
  rm -rf build-gpu/examples
  cmake -S examples/c -B build-gpu/examples -DCMAKE_PREFIX_PATH="$prefix" >>"$out/examples-build.log" 2>&1
  cmake --build build-gpu/examples -j >>"$out/examples-build.log" 2>&1
fi
./build-gpu/examples/hello >"$out/hello.log" 2>&1 || status=1
head -3 "$out/hello.log"; tail -1 "$out/hello.log"
{ cmake -S examples/cpp -B build-gpu/cpp -DCMAKE_PREFIX_PATH="$prefix" && cmake --build build-gpu/cpp -j; } \
  >"$out/cpp-build.log" 2>&1 || { echo "C++ examples did not build (see cpp-build.log)"; status=1; }
./build-gpu/cpp/consumer 2>&1 | tee "$out/consumer.log" || status=1
./build-gpu/cpp/engine 2>&1 | tee "$out/engine.log" || status=1

echo "== benchmark"
traces=()
for t in "$dir"/traces/*.txt.gz; do
  [ -e "$t" ] || continue
  gunzip -c "$t" >"build-gpu/$(basename "$t" .gz)"
  traces+=("build-gpu/$(basename "$t" .gz)")
done
./build-gpu/examples/bench "${traces[@]}" 2>&1 | tee "$out/bench.log" || status=1
exit $status
