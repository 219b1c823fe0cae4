#!/usr/bin/env bash
# Every test that runs without a GPU, on the simulated device. cargo's tests build under the ci
# profile (release's optimisation without its link-time optimisation, target/ci): a dozen test
# binaries, each linked with LTO, took most of the command's time. The C tests, the hit path's
# instruction budget and the packages use the release build (target/release, LTO), which CMake
# makes. AddressSanitizer, which needs a build of its own, runs where it can find something: the
# unsafe and FFI code, and the proptests that inject faults. docs/testing.md says what each step
# checks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
jobs=$(nproc)
start=$SECONDS
# Each step with the time since the start and the CPU time used so far (user and system, of
# every command run): on a machine others share, the first grows with their load, the second
# hardly; a quiet machine of 2 cores takes at least half of it.
# (This shell's children's user and system times, fields 16 and 17 of /proc/$$/stat, in ticks.)
cpu() { awk -v hz="$(getconf CLK_TCK)" '{ t = int(($16 + $17) / hz); printf "%dm%02ds", t / 60, t % 60 }' "/proc/$$/stat"; }
step() { echo "== [$(((SECONDS - start) / 60))m$(((SECONDS - start) % 60))s, CPU $(cpu)] $*"; }

cat <<'EOF'
test.sh: every test that needs no GPU, on the simulated device; 11 to 14 minutes from a fresh
clone on 2 cores (2026-11-29, docs/testing.md; less when target/ and build/ are warm):
  1. cargo test --profile ci: the rules, stress, streams, sleep, IPC, pools, history,
     observers, gpupool-replay, the repository's shape (links, file sizes, import circles,
     layering); all of the tests when there is no nightly toolchain
  2. AddressSanitizer (nightly toolchain), each of these once, here only: the library's unit
     tests, the C API fuzz, the invariant and fault proptests, pinned memory, the hit path
     attacked, the LD_PRELOAD shim
  3. CMake over target/release (the release build, LTO): C tests (shared and static library,
     the soak, fork, a partial libcuda, the Python helper) under CTest, then under valgrind
  4. the LD_PRELOAD shim's report, and the installed package through CMake, pkg-config and
     gpupool-replay
  5. the Python package: its wheel built over the same target/ in a fresh virtual environment,
     installed, and its tests (pytest; numba-cuda from PyPI for the Numba plugin); then
     gpupool_rmm.hpp built against librmm's headers from PyPI and run
EOF

# Step 5's virtual environment, made in the background from the start: its packages come from
# PyPI (about 80 MB on a fresh machine), a download that overlaps the builds instead of waiting
# for them. Its output goes to build/venv.log, shown if it fails.
mkdir -p build
rm -rf build/venv build/wheel
(
  python3 -m venv build/venv
  build/venv/bin/python -m pip install --quiet --upgrade pip
  build/venv/bin/python -m pip install --quiet pytest==9.2.0 numba==0.68.1 numba-cuda==0.30.4 \
    nvidia-cuda-runtime==13.5.37 nvidia-cuda-crt==13.5.37 librmm-cu13==26.10.0
) >build/venv.log 2>&1 &
venv_pid=$!
trap 'kill "$venv_pid" 2>/dev/null || true' EXIT

# The tests that touch unsafe and FFI code, and the proptests that inject faults, run once,
# under AddressSanitizer (its own build, build/asan), when the nightly toolchain is there; every
# other test runs once in step 1. Without nightly, step 1 runs them all. Build scripts and proc
# macros are not instrumented, since --target keeps RUSTFLAGS off them. Leak detection stays on:
# the process-wide allocator is reachable from a static, so only memory lost for good is
# reported; tests/asan/lsan.supp names the one allocation of glibc's it keeps (and why).
asan_tests=(capi invariants host hit)
asan_target="$(rustc -vV | sed -n 's/^host: //p')"
if rustup run nightly rustc --version >/dev/null 2>&1; then
  others=()
  for main in tests/*/main.rs; do
    name=$(basename "$(dirname "$main")")
    [[ " ${asan_tests[*]} " == *" $name "* ]] || others+=(--test "$name")
  done
  step "cargo test --profile ci: gpupool-replay, and gpupool but its unit tests and ${asan_tests[*]}"
  # gpupool-replay's tests and gpupool's in one cargo invocation, so that features resolve once:
  # gpupool's dev-dependencies turn on serde features that a build of gpupool-replay alone does
  # not, and a separate invocation compiled the library and serde again (a minute of a 2-core
  # machine). The preload crate's unit tests run under AddressSanitizer only.
  cargo test --profile ci -p gpupool-replay -p gpupool --test suite --test hostile "${others[@]}"
  # The doc tests with gpupool-replay's (none) in the same package set: the same features again.
  cargo test --profile ci -p gpupool -p gpupool-replay --doc
  step "AddressSanitizer (nightly, $asan_target): the library's unit tests, ${asan_tests[*]}, the LD_PRELOAD shim"
  asan() {
    RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" \
      LSAN_OPTIONS="suppressions=$PWD/tests/asan/lsan.supp" \
      cargo +nightly test --profile ci --target "$asan_target" --target-dir build/asan "$@"
  }
  # One invocation for both crates, for the same reason as step 1's: gpupool-preload built on
  # its own compiled gpupool again, with other serde features (53 s).
  asan -p gpupool -p gpupool-preload --lib "${asan_tests[@]/#/--test=}"
else
  step "cargo test --profile ci --workspace (AddressSanitizer skipped: no nightly Rust toolchain; rustup toolchain install nightly)"
  cargo test --profile ci --workspace
fi

step "C tests (CTest, simulated device), built over target/"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGPUPOOL_BUILD_TESTS=ON -DGPUPOOL_CARGO_DIR="$PWD/target" >/dev/null
cmake --build build -j"$jobs"
# In parallel, a test a core: every C test runs its own process on its own simulated device, and
# the hit path's budget counts instructions (callgrind), which other processes do not change.
ctest --test-dir build --output-on-failure -j"$jobs"
if command -v valgrind >/dev/null 2>&1; then
  step "C API tests under valgrind"
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
  step "valgrind is not installed: the C API tests did not run under it"
fi
step "LD_PRELOAD shim: statistics at exit"
LD_PRELOAD="$PWD/target/release/libgpupool_preload.so" GPUPOOL_DRIVER=sim GPUPOOL_SIM_CAPACITY=64MiB \
  GPUPOOL_PRELOAD_STATS=1 ./build/tests/c/test_preload safe >/dev/null 2>build/preload-stats.txt
grep -q "served 5 cudaMalloc, 1 cudaMallocAsync, 1 cuMemAlloc" build/preload-stats.txt
grep -q "gpupool memory summary, device ID 0" build/preload-stats.txt

step "installed package, C++ consumer"
rm -rf build/install build/cpp
cmake --install build --prefix build/install >/dev/null
cmake -S examples/cpp -B build/cpp -DCMAKE_PREFIX_PATH="$PWD/build/install" >/dev/null
cmake --build build/cpp -j"$jobs"
GPUPOOL_DRIVER=sim ./build/cpp/consumer
# The engine needs a GPU: here it must say why it cannot run, and exit 77 (skipped).
rc=0; ./build/cpp/engine || rc=$?
if [ "$rc" != 77 ] && [ "$rc" != 0 ]; then echo "engine failed: exit $rc" >&2; exit 1; fi
step "installed package, pkg-config"
pc() { PKG_CONFIG_PATH="$PWD/build/install/lib/pkgconfig" pkg-config "$@"; }
# As the README writes it: the rpath from pkg-config's libdir.
cc -Wall -Wextra -Werror examples/c/hello.c -o build/hello_pc $(pc --cflags --libs gpupool) \
  -Wl,-rpath,"$(pc --variable=libdir gpupool)"
GPUPOOL_DRIVER=sim ./build/hello_pc >/dev/null
# The installed headers, together and beside a program's own names; the C++ wrapper from the
# installed include folder.
cc -std=c11 -Wall -Wextra -Wpedantic -Werror tests/c/test_header_names.c -o build/header_names_pc \
  $(pc --cflags --libs gpupool) -Wl,-rpath,"$(pc --variable=libdir gpupool)"
./build/header_names_pc
sh tests/c/header_names.sh build/install/include/gpupool*.h
printf '#include <gpupool.hpp>\nint main() { gpupool::buffer b(1000, nullptr); return b ? 0 : 1; }\n' >build/hpp_pc.cpp
c++ -std=c++17 -Wall -Wextra -Werror build/hpp_pc.cpp -o build/hpp_pc $(pc --cflags --libs gpupool) \
  -Wl,-rpath,"$(pc --variable=libdir gpupool)"
GPUPOOL_DRIVER=sim ./build/hpp_pc
test -f build/install/share/gpupool/python/gpupool_torch.py
step "installed package, gpupool-replay"
# 12 MiB, 500,000 bytes and 3 MiB: under the defaults, expandable segments map 12, 2 and 4 MiB;
# under PyTorch's, ordinary segments of 12, 2 and 20 MiB (replay/tests/suite/peaks.rs).
printf 'a 1 12582912 0\na 2 500000 0\na 3 3145728 0\nf 1\nf 2\nf 3\n' >build/replay-smoke.txt
./build/install/bin/gpupool-replay --csv --conf expandable_segments:False build/replay-smoke.txt 2>/dev/null |
  tee build/replay-smoke.csv
grep -q "^replay-smoke.txt,defaults,sim,.*,18874368," build/replay-smoke.csv
grep -q "^replay-smoke.txt,expandable_segments:False,sim,.*,35651584," build/replay-smoke.csv
test -f build/install/share/gpupool/python/gpupool/__init__.py

# The wheel is built by pip (scikit-build-core over this CMake build, cargo's target/ reused) in
# the fresh virtual environment made since the start, installed there with pytest and numba-cuda
# (pinned: the EMM plugin's test runs Numba's own set_memory_manager), and tested from outside
# the repository's python/ folder, so that only the installed package can be imported.
step "Python package: wheel, fresh virtual environment, pytest"
wait "$venv_pid" || { cat build/venv.log >&2; echo "test.sh: the virtual environment failed" >&2; exit 1; }
build/venv/bin/python -m pip wheel --quiet --no-deps -w build/wheel . -C cmake.define.GPUPOOL_CARGO_DIR="$PWD/target"
build/venv/bin/python -m pip install --quiet --no-deps build/wheel/gpupool-*.whl
# gpupool_rmm.hpp against RMM's and CCCL's headers from the librmm wheel (and the CUDA runtime's
# from PyPI) above, linked with RMM's library: its two programs (about half a minute of C++
# each) compile in the background while pytest, which keeps one core busy, runs; the
# simulated-device one then runs, the GPU half (rmm::device_buffer on real streams) is run by
# scripts/gpu.sh.
site=$(build/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rmm_libs="$site/librmm/lib64:$site/rapids_logger/lib64"
rmm_build() {
  local src=$1 exe=$2
  shift 2
  c++ -std=c++17 -Wall -Wextra -Werror -I"$site/librmm/include" -I"$site/librmm/include/rapids" \
    -I"$site/nvidia/cu13/include" -Iinclude -Iexamples/cpp "$src" -o "$exe" \
    -Ltarget/release -lgpupool -L"$site/librmm/lib64" -lrmm -L"$site/rapids_logger/lib64" -lrapids_logger \
    -Wl,-rpath,"$PWD/target/release:$rmm_libs" "$@"
}
rmm_build tests/rmm/test_rmm.cpp build/test_rmm >build/rmm-build.log 2>&1 &
rmm_pid=$!
rmm_build tests/rmm/test_rmm_gpu.cpp build/test_rmm_gpu -L"$site/nvidia/cu13/lib" -l:libcudart.so.13 \
  >build/rmm-gpu-build.log 2>&1 &
rmm_gpu_pid=$!
trap 'kill "$venv_pid" "$rmm_pid" "$rmm_gpu_pid" 2>/dev/null || true' EXIT
(cd build && GPUPOOL_TEST_INSTALLED=1 venv/bin/python -m pytest -p no:cacheprovider ../tests/python/package)

step "RMM: gpupool_rmm.hpp against librmm's headers, on the simulated device"
wait "$rmm_pid" || { cat build/rmm-build.log >&2; echo "test.sh: tests/rmm/test_rmm.cpp did not build" >&2; exit 1; }
wait "$rmm_gpu_pid" ||
  { cat build/rmm-gpu-build.log >&2; echo "test.sh: tests/rmm/test_rmm_gpu.cpp did not build" >&2; exit 1; }
GPUPOOL_DRIVER=sim GPUPOOL_SIM_DEVICES=2 ./build/test_rmm
step "done"
echo "test.sh: all tests passed"
