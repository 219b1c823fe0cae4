#!/usr/bin/env bash
# Every test that runs without a GPU: the Rust tests (rules, invariant checker with fault
# injection, stress, the C API fuzz, stream scaling), again under AddressSanitizer when a nightly
# toolchain is installed, the C tests under CTest against the shared and the static library (the
# soak, fork, and valgrind runs when it is installed), and a C++ project that finds an installed gpupool with
# find_package(gpupool CONFIG REQUIRED).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
jobs=$(nproc)

echo "== cargo test"
cargo test --release --workspace

# AddressSanitizer over the Rust tests, with the nightly toolchain these machines carry (the
# instrumented build goes to build/asan; build scripts and proc macros are not instrumented,
# since --target keeps RUSTFLAGS off them). Leak detection stays on: the process-wide allocator
# is reachable from a static, so only memory lost for good is reported.
asan_target="$(rustc -vV | sed -n 's/^host: //p')"
if rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "== Rust tests under AddressSanitizer (nightly, $asan_target)"
  RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" \
    cargo +nightly test --release --workspace --lib --tests --target "$asan_target" --target-dir build/asan
else
  echo "== AddressSanitizer skipped: no nightly Rust toolchain (rustup toolchain install nightly)"
fi

echo "== C tests (CTest, simulated device)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGPUPOOL_BUILD_TESTS=ON >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure
if command -v valgrind >/dev/null 2>&1; then
  echo "== C API tests under valgrind"
  # Only memory lost for good fails (see c_thread_exit in tests/c/CMakeLists.txt): the
  # process-wide allocator's hash tables and arc-swap snapshot, alive until exit, are reachable
  # only through interior pointers, which valgrind reports as "possibly lost". Nothing is
  # suppressed: no allocation of Rust's std or of a dependency is lost either.
  for kind in shared static; do
    GPUPOOL_DRIVER=sim GPUPOOL_SIM_DEVICES=2 GPUPOOL_SIM_CAPACITY=1GiB valgrind --quiet --error-exitcode=1 \
      --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite \
      ./build/tests/c/test_api_$kind 2>build/valgrind-test_api_$kind.log >/dev/null ||
      { cat build/valgrind-test_api_$kind.log >&2; echo "valgrind: test_api_$kind failed" >&2; exit 1; }
    echo "test_api_$kind: no errors, nothing lost (build/valgrind-test_api_$kind.log)"
  done
else
  echo "== valgrind is not installed: the C API tests did not run under it"
fi
echo "== LD_PRELOAD shim: statistics at exit"
LD_PRELOAD="$PWD/build/cargo/release/libgpupool_preload.so" GPUPOOL_DRIVER=sim GPUPOOL_SIM_CAPACITY=64MiB \
  GPUPOOL_PRELOAD_STATS=1 ./build/tests/c/test_preload safe >/dev/null 2>build/preload-stats.txt
grep -q "served 5 cudaMalloc, 1 cudaMallocAsync, 1 cuMemAlloc" build/preload-stats.txt
grep -q "gpupool memory summary, device ID 0" build/preload-stats.txt

echo "== installed package, C++ consumer"
rm -rf build/install build/cpp
cmake --install build --prefix build/install >/dev/null
cmake -S examples/cpp -B build/cpp -DCMAKE_PREFIX_PATH="$PWD/build/install" >/dev/null
cmake --build build/cpp -j"$jobs"
GPUPOOL_DRIVER=sim ./build/cpp/consumer
# The engine needs a GPU: here it must say why it cannot run, and exit 77 (skipped).
rc=0; ./build/cpp/engine || rc=$?
if [ "$rc" != 77 ] && [ "$rc" != 0 ]; then echo "engine failed: exit $rc" >&2; exit 1; fi
echo "== installed package, pkg-config"
PKG_CONFIG_PATH="$PWD/build/install/lib/pkgconfig" cc -Wall -Wextra -Werror examples/c/hello.c -o build/hello_pc \
  $(PKG_CONFIG_PATH="$PWD/build/install/lib/pkgconfig" pkg-config --cflags --libs gpupool) -Wl,-rpath,"$PWD/build/install/lib"
GPUPOOL_DRIVER=sim ./build/hello_pc >/dev/null
# The three installed headers, together and beside a program's own names.
PKG_CONFIG_PATH="$PWD/build/install/lib/pkgconfig" cc -std=c11 -Wall -Wextra -Wpedantic -Werror \
  tests/c/test_header_names.c -o build/header_names_pc \
  $(PKG_CONFIG_PATH="$PWD/build/install/lib/pkgconfig" pkg-config --cflags --libs gpupool) -Wl,-rpath,"$PWD/build/install/lib"
./build/header_names_pc
sh tests/c/header_names.sh build/install/include/gpupool*.h
echo "== installed package, gpupool-replay"
# 12 MiB, 500,000 bytes and 3 MiB take segments of 12, 2 and 20 MiB (replay/tests/peaks.rs).
printf 'a 1 12582912 0\na 2 500000 0\na 3 3145728 0\nf 1\nf 2\nf 3\n' >build/replay-smoke.txt
./build/install/bin/gpupool-replay --csv build/replay-smoke.txt 2>/dev/null | tee build/replay-smoke.csv
grep -q "^replay-smoke.txt,defaults,sim,.*,35651584," build/replay-smoke.csv
echo "test.sh: all tests passed"
