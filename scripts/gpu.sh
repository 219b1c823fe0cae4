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
  strip --strip-debug "$dir/prefix/lib/libgpupool.a" "$dir/prefix/lib/libgpupool.so" "$dir/prefix/lib/libgpupool_preload.so"
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

# Configures the CMake project in $1 against the installed gpupool into $2, with the further
# arguments given, and builds it. The caller sends the output to a log.
build_against_prefix() {
  local source=$1 build=$2
  shift 2
  cmake -S "$source" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" "$@" && cmake --build "$build" -j
}

echo "== C tests with GPUPOOL_DRIVER=cuda"
build_against_prefix tests/c build-gpu/c -DGPUPOOL_TEST_DRIVER=cuda >"$out/c-tests.log" 2>&1
ctest --test-dir build-gpu/c --output-on-failure -E c_no_driver >>"$out/c-tests.log" 2>&1 || status=1
grep -E "tests passed|Failed|passed," "$out/c-tests.log" || true

echo "== GPU tests"
build_against_prefix tests/gpu build-gpu/gpu >"$out/gpu-tests.log" 2>&1
./build-gpu/gpu/test_gpu 2>&1 | tee -a "$out/gpu-tests.log" || status=1

echo "== examples"
torch_dir=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
if ! build_against_prefix examples/c build-gpu/examples -DGPUPOOL_TORCH_DIR="$torch_dir" \
  >"$out/examples-build.log" 2>&1; then
  echo "bench with PyTorch did not build (see examples-build.log); building it without"
  rm -rf build-gpu/examples
  build_against_prefix examples/c build-gpu/examples >>"$out/examples-build.log" 2>&1
fi
./build-gpu/examples/hello >"$out/hello.log" 2>&1 || status=1
head -3 "$out/hello.log"; tail -1 "$out/hello.log"
build_against_prefix examples/cpp build-gpu/cpp >"$out/cpp-build.log" 2>&1 ||
  { echo "C++ examples did not build (see cpp-build.log)"; status=1; }
./build-gpu/cpp/consumer 2>&1 | tee "$out/consumer.log" || status=1
./build-gpu/cpp/engine 2>&1 | tee "$out/engine.log" || status=1

echo "== LD_PRELOAD shim"
preload="$prefix/lib/libgpupool_preload.so"
p=build-gpu/preload
# Runs $p/$1 as it is (output in $out/$2-native.txt) and under the shim with its statistics
# at exit ($out/$2-shim.txt, and its stderr in $out/$2-shim.err); a failed run sets status=1.
run_without_and_with_shim() {
  ./$p/$1 >"$out/$2-native.txt" 2>&1 || status=1
  LD_PRELOAD="$preload" GPUPOOL_PRELOAD_STATS=1 ./$p/$1 >"$out/$2-shim.txt" 2>"$out/$2-shim.err" || status=1
}
# The same, and the program must print the same under the shim.
compare_without_and_with_shim() {
  run_without_and_with_shim "$1" "$2"
  cmp -s "$out/$2-native.txt" "$out/$2-shim.txt" && echo "$1: identical output under the shim" ||
    { echo "$1: output differs under the shim"; status=1; }
}
if build_against_prefix tests/preload $p >"$out/preload-build.log" 2>&1; then
  # An unmodified runtime-API program (-cudart shared): the same output, and its traffic in
  # gpupool's statistics (60 rounds of 3 cudaMalloc).
  compare_without_and_with_shim app app
  grep -q "served 180 cudaMalloc" "$out/app-shim.err" || { echo "app: the shim did not serve its cudaMalloc"; status=1; }
  grep "served" "$out/app-shim.err" || true
  # The opt-in stream mode is documented as wrong for this program (it relies on cudaFree
  # waiting across streams): shown, not required.
  LD_PRELOAD="$preload" GPUPOOL_PRELOAD_MODE=stream ./$p/app >"$out/app-stream-mode.txt" 2>&1 &&
    echo "app, stream mode: no wrong sum this time" || echo "app, stream mode: $(tail -1 "$out/app-stream-mode.txt")"
  # The runtime linked statically: what the shim catches of it.
  compare_without_and_with_shim app_static app-static
  echo "app_static: $(grep -o "served [^;]*" "$out/app-static-shim.err" || echo "the shim never started")"
  # The driver API: two cuMemAlloc (direct, and through cuGetProcAddress) and one
  # cuMemAllocAsync served; the allocation in the program's own context passed through.
  run_without_and_with_shim driver_app driver
  cat "$out/driver-shim.txt"
  grep -q "served 0 cudaMalloc, 0 cudaMallocAsync, 2 cuMemAlloc, 1 cuMemAllocAsync" "$out/driver-shim.err" &&
    grep -q "passed through 1 allocations" "$out/driver-shim.err" && echo "driver_app: caught as claimed" ||
    { echo "driver_app: not caught as claimed"; grep served "$out/driver-shim.err" || true; status=1; }
else
  echo "LD_PRELOAD tests did not build (see preload-build.log)"
  status=1
fi

echo "== PyTorch: pluggable allocator, and the shim under PYTORCH_NO_CUDA_MEMORY_CACHING=1"
if python3 -c "import torch, torchvision, transformers" 2>/dev/null; then
  python3 examples/python/compare.py --lib "$prefix/lib/libgpupool.so" --preload "$preload" \
    --out "$out/python" 2>&1 | tee "$out/python.log" || status=1
else
  echo "skipped: python3 lacks torch, torchvision or transformers"
fi

echo "== benchmark"
traces=()
for t in "$dir"/traces/*.txt.gz; do
  [ -e "$t" ] || continue
  gunzip -c "$t" >"build-gpu/$(basename "$t" .gz)"
  traces+=("build-gpu/$(basename "$t" .gz)")
done
./build-gpu/examples/bench "${traces[@]}" 2>&1 | tee "$out/bench.log" || status=1
exit $status
