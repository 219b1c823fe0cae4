#!/usr/bin/env bash
# gpupool on a GPU, in two steps, because the GPU machine has CUDA, CMake and PyTorch but no
# Rust toolchain.
#
#   scripts/gpu.sh prepare [DIR]   where cargo is: build, install gpupool (with bin/gpupool-replay)
#                                  into DIR/prefix, copy the Rust test binaries to DIR/bin and
#                                  the traces to DIR/traces
#                                  (DIR defaults to .device, which git ignores)
#   scripts/gpu.sh prepare-base DIR REV
#                                  where cargo is: the library of commit REV into DIR/base, for
#                                  section ab
#   scripts/gpu.sh run [DIR] [OUT] on the GPU machine: build the C tests, the GPU tests and the
#                                  examples against DIR/prefix, run every test with
#                                  GPUPOOL_DRIVER=cuda (the Rust tests run on the simulated
#                                  device there too), then the examples, record new traces from
#                                  models with dynamic shapes, and run the benchmark on those and
#                                  DIR/traces; logs go to OUT (default DIR/out), the recorded
#                                  traces to OUT/traces
#
# GPU_SECTIONS picks what `run` does, names separated by spaces or commas (default: all but ab
# and llama):
#   rust        the Rust tests (simulated device)
#   c           the C API tests on the real driver
#   ipc         tests/c/test_ipc.c on the GPU (memory shared between processes: a producer and
#               two forked consumers; bit for bit, 10,000 export/import/close cycles with the
#               consumer's VmSize, descriptors and the device's free memory flat, a block freed
#               while imported, a SIGKILLed consumer, garbage handles, a device-1 block imported
#               on device 0 with two GPUs), with expandable segments and with ordinary ones; then
#               what torch.multiprocessing does with a CUDA tensor under gpupool's pluggable
#               allocator; OUT/ipc.log
#   gpu         tests/gpu/test_gpu
#   expandable  tests/gpu/test_expandable (expandable segments)
#   budget      tests/gpu/test_budget (per-pool budgets under load: a tenant refused in a loop,
#               another pool never, the limit changed meanwhile), with expandable and ordinary
#               segments; OUT/budget.log
#   dmabuf      tests/gpu/test_dmabuf (gpupool_segment_mapped_range: a segment's whole mapped
#               range and its dma-buf descriptor, lseek's size against the range's; an ordinary
#               segment, then an expandable one grown by a second block and shrunk by
#               gpupool_empty_cache; skipped where CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0),
#               into OUT/dmabuf.log
#   streams     tests/gpu/test_streams (a stream per step for 1,000 steps, slow readers), with
#               ordinary segments, expandable segments, and expandable segments with the rule;
#               tests/gpu/test_rule_wait (the rule waits for the growing stream, not the device)
#   graphs      tests/gpu/test_graphs (CUDA graph capture with private pools) and
#               examples/python/graphs.py (torch.cuda.graph on gpupool's private pools)
#   sleep       tests/gpu/test_sleep (gpupool_sleep and gpupool_wake: free memory to the byte,
#               contents and a CUDA graph restored, a wake without memory) and its benchmark
#               (offload and restore against the pinned copy bandwidth of the run, 80% the
#               target, and the host's resident memory before, during and after; the same with
#               GPUPOOL_SLEEP_OFFLOAD_PINNED, and the unmap and map times alone; sizes from
#               GPUPOOL_SLEEP_BENCH_GIB, default "1 4 16 40"), into OUT/sleep.log;
#               tests/gpu/test_first_sleep (the first pinned sleep's GB/s with and without
#               gpupool_sleep_prepare, GPUPOOL_FIRST_SLEEP_GIB default "4 16"), into
#               OUT/first-sleep.log; with two GPUs, tests/gpu/test_peers (peer access only after
#               gpupool_enable_peer_access, by cuMemGetAccess and copies, and the map cost per
#               page of GPUPOOL_PEERS_GIB GiB, default 4, with no peer, one, and every device),
#               into OUT/peers.log, and
#               tests/gpu/test_two_gpus (a pool on each slept and woken at once from two
#               threads), into OUT/two-gpus.log
#   sleep_tune  the sleep benchmark alone (`test_sleep bench`, sizes from GPUPOOL_SLEEP_BENCH_GIB,
#               default "4 16" here) once per staging setting of SLEEP_TUNE, a list of
#               CHUNK:BUFFERS:THREADS:HUGE_PAGES (GPUPOOL_SLEEP_CHUNK, _BUFFERS, _THREADS,
#               _HUGE_PAGES; default a grid of 8 around 32M:4:8:1), into OUT/sleep-tune.log
#   torch_sleep tests/gpu/torch_sleep.py: a transformers Llama decoder's weights in one gpupool
#               pool (gpupool.torch.use_pool, offload) and its generation state in another
#               (discard): generate, sleep both (device free memory up by what they held), wake,
#               the weights bit for bit and the same token ids again; OUT/torch_sleep.log
#   torch_fallback tests/gpu/torch_fallback.py: what torch.cuda.MemPool(use_on_oom=,
#               no_split=) does under the pluggable allocator (reported), then a
#               gpupool.Pool(use_on_oom=True) serving a default tensor once the GPU is full, and a
#               gpupool.Pool(no_split=True)'s whole blocks; OUT/torch_fallback.log
#   examples    hello, the C++ consumer, engine and engine_graphs (both sleep: see docs/gpu.md)
#   nccl        examples/cpp/nccl_register.cpp: every segment registered with an NCCL
#               communicator through a segment observer (one rank per GPU, each on its own
#               thread), an all-reduce on gpupool blocks checked;
#               with expandable segments and with ordinary ones (nccl.h from the CUDA toolkit,
#               PyTorch's include dir or the nvidia-nccl package; /usr/lib/x86_64-linux-gnu/libnccl.so.2)
#   preload     the LD_PRELOAD shim's programs
#   jax         examples/python/jax_workload.py (a training step, an inference loop over changing
#               shapes) under XLA's BFC pool, cuda_async, platform, and platform under the shim,
#               each of the last two also with XLA_FLAGS' --xla_gpu_experimental_vmm_disabled=true
#               (XLA's cuMemAlloc instead of its cuMemCreate/cuMemMap; the shim serves only the
#               former): results bit for bit, time, the device's peak use, the shim's report
#               (served, and the calls it passed through by name); OUT/jax.log
#   python      examples/python/compare.py (PyTorch against gpupool, and under the shim)
#   models      examples/python/dynamic_compare.py: record_trace.py's models with dynamic shapes
#               (MODELS_WORKLOADS, default bert_infer,gpt2_generate,resnet_train) under PyTorch's
#               allocator, its expandable segments and gpupool (pluggable), MODELS_ROUNDS rounds
#               (default 2): identical outputs, median pass time, peak reserved; OUT/models.log
#               and OUT/models/
#   traces      examples/python/record_trace.py into build-gpu/traces (RECORD_WORKLOADS: which, e.g.
#               t5_generate,bert_train; default all)
#   snapshot    examples/python/dump_snapshot.py: one model's allocation history and snapshot
#               under PyTorch's allocator and under gpupool, both rendered by PyTorch's viewer
#               (trace_plot, segment_plot) into OUT/snapshot; examples/python/annotated_snapshot.py:
#               metadata, an annotated tensor, dumps with and without traces at 100,000 events
#   frames      examples/python/frames_cost.py --torch: ns per torch.empty with Python frames
#               in the history, PyTorch's against gpupool's, and a small model's snapshot
#               through gpupool read by PyTorch's viewer code, into OUT/frames
#   bench       examples/c/bench with DIR/traces and build-gpu/traces (recorded by this run or
#               an earlier one); BENCH_ONLY=main or frag passes through to it
#   host        pinned host memory: tests/gpu/test_host (a copy in flight keeps its block), then
#               examples/c/bench_host (gpupool against cudaHostAlloc, PyTorch's
#               CachingHostAllocator and pageable memory), its table in OUT/bench-host.log;
#               with DIR/base/libgpupool.so there, its hit pairs with base and this library
#               alternating (base, new, base, new) into OUT/bench-host-ab.log
#   threads     examples/c/thread_scaling on the simulated device (this host's CPUs and gpupool
#               alone): 1, 4, 8 and 16 threads on one device and on a device each, M ops/s and
#               peak settles per million calls; with DIR/base/libgpupool.so there, base and this
#               library alternating (base, new, base, new), each run's library named by ldd;
#               OUT/threads.log
#   ab          bench's main table (BENCH_ONLY=main) with DIR/base/libgpupool.so (the library
#               before a change: put it there with `scripts/gpu.sh prepare-base REV`) and with
#               the new one, alternating base, new, base, new, each run's loaded library named
#               by ldd; logs in OUT/ab-*.log
#   plugins     tests/gpu/plugins.py: the gpupool Python package (the wheel `prepare` built,
#               installed into build-gpu/python) under CuPy (its current stream, and a fixed
#               stream through CFunctionAllocator), Numba (NUMBA_CUDA_MEMORY_MANAGER=
#               gpupool.numba), PyTorch, CuPy and Numba in one process, and ONNX Runtime where it
#               has the CUDA execution provider: identical results against each framework's own
#               allocator, gpupool's statistics seeing the blocks; OUT/plugins.txt; then
#               tests/rmm/test_rmm_gpu.cpp (rmm::device_buffer on gpupool) against the librmm
#               wheel `prepare` downloaded
#   cupy        examples/python/cupy_mixed.py: a mixed CuPy workload (matrix products, FFTs,
#               sorts, reductions over changing shapes on three streams, 300 steps) under CuPy's
#               MemoryPool, gpupool's compiled hook (gpupool.cupy.install()) and gpupool's Python
#               route (install(compiled=False)), fresh processes alternating, 5 runs each
#               (CUPY_MIXED_REPS): median seconds and the ratio to CuPy's, ns per cupy.empty and
#               free, peak reserved, identical results, a silent exit with arrays alive;
#               OUT/cupy_mixed.txt and .json (the package as the plugins section finds it)
#   llama       llama.cpp's CUDA backend (built here from DIR/llama.tar.gz, which
#               scripts/llama_src.sh makes, with ggml's VMM pool and with its legacy pool) on a
#               random Llama model: greedy generation without the shim and under it, the same
#               tokens required, tokens/s, peak device memory, what the shim served, and its
#               snapshot at exit read as PyTorch's (scripts/gpu_llama.sh); OUT/llama.log,
#               OUT/llama-runs.log, OUT/llama-*.pickle
#   replay      gpupool-replay --driver cuda on DIR/traces/llama_decode.txt.gz, with the
#               defaults (expandable segments) and with expandable_segments:False (PyTorch's
#               ordinary segments), then the same on the simulated
#               device for comparison; table and JSON in OUT/replay-*
# e.g. GPU_SECTIONS="expandable traces bench" scripts/gpu.sh run for a short session. `run`
# stops at nothing and exits 1 at the end if anything it ran failed.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
dir=${2:-.device}

if [ "$step" = prepare ]; then
  source scripts/deps.sh
  rm -rf "$dir/prefix" "$dir/bin" "$dir/traces" "$dir/wheels"
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
  strip "$dir/prefix/bin/gpupool-replay"
  # The Python package as a wheel (pyproject.toml, over the same cargo build), for the plugins
  # section; without it, that section uses the prefix's copy of the package.
  cargo_dir=$(sed -n 's/^GPUPOOL_CARGO_DIR:PATH=//p' build/CMakeCache.txt)
  python3 -m pip wheel --quiet --no-deps -w "$dir/wheels" . -C cmake.define.GPUPOOL_CARGO_DIR="${cargo_dir:-$PWD/build/cargo}" ||
    echo "the wheel did not build: the plugins section will use $dir/prefix/share/gpupool/python"
  # RMM's library and headers for tests/rmm/test_rmm_gpu.cpp (the GPU machine has no RMM): 5 MiB.
  python3 -m pip download --quiet --no-deps -d "$dir/wheels" librmm-cu13==26.10.0 rapids-logger==0.3.0 ||
    echo "librmm did not download: the plugins section will skip RMM"
  # The traces the repository ships, and the larger set beside a development checkout.
  cp replay/traces/*.txt.gz "$dir/traces/"
  shared=../shared/traces
  if [ -d "$shared" ]; then cp "$shared"/*.txt.gz "$dir/traces/"; fi
  du -sh "$dir"
  exit 0
fi

# The library of revision REV (a commit), built in a worktree of its own, into DIR/base: what
# section `ab` compares this checkout's library with.
if [ "$step" = prepare-base ]; then
  rev=${3:-}
  [ -n "$rev" ] || { echo "usage: scripts/gpu.sh prepare-base DIR REV" >&2; exit 2; }
  wt="$dir/base-src"
  rm -rf "$wt" "$dir/base"
  git worktree prune
  git worktree add --detach "$wt" "$rev" >/dev/null
  (cd "$wt" && cargo build --release --lib --quiet)
  mkdir -p "$dir/base"
  cp "$wt/target/release/libgpupool.so" "$dir/base/"
  strip --strip-debug "$dir/base/libgpupool.so"
  git worktree remove --force "$wt"
  exit 0
fi

if [ "$step" != run ]; then
  echo "usage: scripts/gpu.sh prepare|run [DIR] [OUT], or prepare-base DIR REV" >&2
  exit 2
fi
out=${3:-$dir/out}
all_sections="rust c ipc gpu expandable budget dmabuf streams graphs sleep sleep_tune torch_sleep torch_fallback examples preload jax python models traces snapshot frames bench threads ab replay host plugins cupy nccl llama"
# Every section but ab, which needs DIR/base, and llama (minutes of building), by default.
default_sections=${all_sections/ ab / }
sections=${GPU_SECTIONS:-${default_sections% llama}}
sections=${sections//,/ }
for s in $sections; do
  case " $all_sections " in
  *" $s "*) ;;
  *)
    echo "GPU_SECTIONS: unknown section '$s' (known: $all_sections)" >&2
    exit 2
    ;;
  esac
done
# Whether section $1 is to run.
want() { case " $sections " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$out" build-gpu
prefix=$(cd "$dir/prefix" && pwd)
export GPUPOOL_DRIVER=cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt" ||
  echo "no nvidia-smi here"
status=0

if want rust; then
  echo "== Rust tests (simulated device)"
  for t in "$dir"/bin/*; do "$t" --quiet >>"$out/rust-tests.log" 2>&1 || status=1; done
  grep -E "test result" "$out/rust-tests.log" || true
fi

# Configures the CMake project in $1 against the installed gpupool into $2, with the further
# arguments given, and builds it. The caller sends the output to a log.
build_against_prefix() {
  local source=$1 build=$2
  shift 2
  cmake -S "$source" -B "$build" -DCMAKE_PREFIX_PATH="$prefix" "$@" && cmake --build "$build" -j
}

if want c; then
  echo "== C tests with GPUPOOL_DRIVER=cuda"
  build_against_prefix tests/c build-gpu/c -DGPUPOOL_TEST_DRIVER=cuda >"$out/c-tests.log" 2>&1
  ctest --test-dir build-gpu/c --output-on-failure -E c_no_driver >>"$out/c-tests.log" 2>&1 || status=1
  grep -E "tests passed|Failed|passed," "$out/c-tests.log" || true
fi

if want ipc; then
  echo "== IPC: tests/c/test_ipc.c with GPUPOOL_DRIVER=cuda"
  if build_against_prefix tests/c build-gpu/c -DGPUPOOL_TEST_DRIVER=cuda >"$out/ipc-build.log" 2>&1; then
    : >"$out/ipc.log"
    for conf in expandable_segments:True expandable_segments:False; do
      echo "-- GPUPOOL_CONF=$conf" | tee -a "$out/ipc.log"
      GPUPOOL_CONF=$conf ./build-gpu/c/test_ipc 2>&1 | tee -a "$out/ipc.log" || status=1
    done
  else
    echo "tests/c did not build (see ipc-build.log)"
    status=1
  fi
  # torch.multiprocessing pickles a CUDA tensor through its allocator's shareIpcHandle, which
  # PyTorch's CUDAPluggableAllocator refuses: expected "does not yet support shareIPcHandle".
  if python3 -c "import torch" 2>/dev/null; then
    GPUPOOL_LIB="$prefix/lib/libgpupool.so" PYTHONPATH="$prefix/share/gpupool/python" python3 -c '
import torch, gpupool.torch
from torch.multiprocessing.reductions import reduce_tensor
gpupool.torch.install()
t = torch.ones(1 << 20, device="cuda")
try:
    reduce_tensor(t)
    print("torch.multiprocessing under gpupool: reduce_tensor of a CUDA tensor succeeded")
except Exception as e:
    print("torch.multiprocessing under gpupool: reduce_tensor of a CUDA tensor raised", type(e).__name__, e)
' 2>&1 | tee -a "$out/ipc.log" || true
  fi
fi

# Builds the GPU test $1 (tests/gpu/$1.cu) and runs it, its output in $out/$2; each test is
# built on its own, so that one that does not compile does not stop the other.
run_gpu_test() {
  if cmake --build build-gpu/gpu -j --target "$1" >>"$out/gpu-tests-build.log" 2>&1; then
    ./build-gpu/gpu/"$1" 2>&1 | tee "$out/$2" || status=1
  else
    echo "$1 did not build (see gpu-tests-build.log)"
    status=1
  fi
}
if want gpu || want expandable || want budget || want dmabuf || want graphs || want streams || want sleep || want sleep_tune; then
  echo "== GPU tests"
  if cmake -S tests/gpu -B build-gpu/gpu -DCMAKE_PREFIX_PATH="$prefix" >"$out/gpu-tests-build.log" 2>&1; then
    if want gpu; then run_gpu_test test_gpu gpu-tests.log; fi
    if want expandable; then run_gpu_test test_expandable expandable.log; fi
    if want budget; then
      run_gpu_test test_budget budget.log
      if [ -x build-gpu/gpu/test_budget ]; then
        GPUPOOL_CONF=expandable_segments:False ./build-gpu/gpu/test_budget 2>&1 | tee -a "$out/budget.log" || status=1
      fi
    fi
    if want graphs; then run_gpu_test test_graphs graphs.log; fi
    if want dmabuf; then
      : >"$out/dmabuf.log"
      if cmake --build build-gpu/gpu -j --target test_dmabuf >>"$out/gpu-tests-build.log" 2>&1; then
        for kind in ordinary expandable; do
          ./build-gpu/gpu/test_dmabuf "$kind" 2>&1 | tee -a "$out/dmabuf.log" || status=1
        done
      else
        echo "test_dmabuf did not build (see gpu-tests-build.log)"
        status=1
      fi
    fi
    if want sleep; then
      run_gpu_test test_sleep sleep.log
      run_gpu_test test_first_sleep first-sleep.log
      run_gpu_test test_two_gpus two-gpus.log
      run_gpu_test test_peers peers.log
    fi
    if want sleep_tune && cmake --build build-gpu/gpu -j --target test_sleep >>"$out/gpu-tests-build.log" 2>&1; then
      echo "== sleep_tune"
      : >"$out/sleep-tune.log"
      for t in ${SLEEP_TUNE:-32M:4:8:1 16M:4:8:1 64M:4:8:1 32M:8:8:1 32M:4:4:1 32M:4:16:1 32M:4:8:0 64M:8:16:1}; do
        IFS=: read -r chunk buffers threads huge <<<"$t"
        echo "-- $t" | tee -a "$out/sleep-tune.log"
        GPUPOOL_SLEEP_BENCH_GIB=${GPUPOOL_SLEEP_BENCH_GIB:-4 16} GPUPOOL_SLEEP_CHUNK=$chunk GPUPOOL_SLEEP_BUFFERS=$buffers \
          GPUPOOL_SLEEP_THREADS=$threads GPUPOOL_SLEEP_HUGE_PAGES=$huge ./build-gpu/gpu/test_sleep bench 2>&1 |
          tee -a "$out/sleep-tune.log" || status=1
      done
    elif want sleep_tune; then
      echo "test_sleep did not build (see gpu-tests-build.log)"
      status=1
    fi
    if want streams; then
      export GPUPOOL_RELEASE_UNUSED_STREAMS=1
      GPUPOOL_CONF=expandable_segments:False run_gpu_test test_streams streams-ordinary.log
      GPUPOOL_CONF=expandable_segments:True run_gpu_test test_streams streams-expandable.log
      GPUPOOL_CONF=expandable_segments:True GPUPOOL_EXPANDABLE_RECLAIM=1 run_gpu_test test_streams streams-rule.log
      unset GPUPOOL_RELEASE_UNUSED_STREAMS
      run_gpu_test test_rule_wait rule-wait.log
    fi
  else
    echo "GPU tests did not configure (see gpu-tests-build.log)"
    status=1
  fi
fi

# Builds examples/c (hello and bench, with PyTorch's allocator in bench when it builds), once.
examples_built=0
build_examples() {
  [ "$examples_built" = 0 ] || return 0
  examples_built=1
  local torch_dir
  torch_dir=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
  if ! build_against_prefix examples/c build-gpu/examples -DGPUPOOL_TORCH_DIR="$torch_dir" \
    -DGPUPOOL_BENCH_HOST_TORCH=OFF >"$out/examples-build.log" 2>&1; then
    echo "bench with PyTorch did not build (see examples-build.log); building it without"
    rm -rf build-gpu/examples
    build_against_prefix examples/c build-gpu/examples >>"$out/examples-build.log" 2>&1 ||
      { echo "examples/c did not build (see examples-build.log)"; status=1; }
  fi
}

if want examples; then
  echo "== examples"
  build_examples
  ./build-gpu/examples/hello >"$out/hello.log" 2>&1 || status=1
  head -3 "$out/hello.log"; tail -1 "$out/hello.log"
  build_against_prefix examples/cpp build-gpu/cpp >"$out/cpp-build.log" 2>&1 ||
    { echo "C++ examples did not build (see cpp-build.log)"; status=1; }
  ./build-gpu/cpp/consumer 2>&1 | tee "$out/consumer.log" || status=1
  ./build-gpu/cpp/engine 2>&1 | tee "$out/engine.log" || status=1
  ./build-gpu/cpp/engine_graphs 2>&1 | tee "$out/engine_graphs.log" || status=1
  # A 16-layer network of narrow layers: bound by launches, where graphs pay.
  ./build-gpu/cpp/engine_graphs 1000 16 2>&1 | tee "$out/engine_graphs_deep.log" || status=1
fi

preload="$prefix/lib/libgpupool_preload.so"
if want preload; then
  echo "== LD_PRELOAD shim"
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
    # The driver opened by the program (XLA's way): every cuMemAlloc it makes served, found by
    # dlsym in its handle and through cuGetProcAddress.
    run_without_and_with_shim dlopen_app dlopen
    cat "$out/dlopen-shim.txt"
    n=$(sed -n 's/^dlopen_app: ok, \([0-9]*\) cuMemAlloc$/\1/p' "$out/dlopen-shim.txt")
    [ -n "$n" ] && grep -q "served 0 cudaMalloc, 0 cudaMallocAsync, $n cuMemAlloc, 0 cuMemAllocAsync" "$out/dlopen-shim.err" &&
      echo "dlopen_app: caught as claimed" ||
      { echo "dlopen_app: not caught as claimed"; grep "served\|lookups" "$out/dlopen-shim.err" || true; status=1; }
    # JAX, where installed: XLA opens the driver itself, and with
    # XLA_PYTHON_CLIENT_ALLOCATOR=platform and its virtual memory calls turned off every buffer
    # is a cuMemAlloc, which the shim must serve (no cuMemCreate passed through), printing the
    # same result (2^30, exact in float32). docs/preload.md, "What XLA calls".
    if python3 -c "import jax" 2>/dev/null; then
      jax_prog='import jax, jax.numpy as jnp; x = jnp.ones((1024, 1024)); print(float((x @ x).sum()), jax.devices()[0].platform)'
      # The switch exists from jaxlib 0.12 on; an older XLA maps every buffer itself (cuMemCreate),
      # which the shim can only count: then the same output and the counted calls are required.
      jax_env=(XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_experimental_vmm_disabled=true)
      if ! env "${jax_env[@]}" python3 -c "$jax_prog" >"$out/jax-native.txt" 2>"$out/jax-native.err" &&
        grep -q "Unknown flag in XLA_FLAGS" "$out/jax-native.err"; then
        echo "jax: this XLA has no --xla_gpu_experimental_vmm_disabled (jaxlib 0.12 added it): its buffers are cuMemCreate's"
        jax_env=(XLA_PYTHON_CLIENT_ALLOCATOR=platform)
        env "${jax_env[@]}" python3 -c "$jax_prog" >"$out/jax-native.txt" 2>"$out/jax-native.err" || status=1
        jax_vmm=1
      else
        jax_vmm=0
      fi
      env "${jax_env[@]}" LD_PRELOAD="$preload" GPUPOOL_PRELOAD_STATS=1 python3 -c "$jax_prog" \
        >"$out/jax-shim.txt" 2>"$out/jax-shim.err" || status=1
      cat "$out/jax-shim.txt"
      grep "passed through .* calls to" "$out/jax-shim.err" || true
      if [ "$jax_vmm" = 1 ]; then
        cmp -s "$out/jax-native.txt" "$out/jax-shim.txt" && grep -q " gpu$" "$out/jax-shim.txt" &&
          grep -q "calls to cuMemCreate" "$out/jax-shim.err" && echo "jax: same output; XLA's cuMemCreate passed through and counted" ||
          { echo "jax: not as claimed"; grep "served\|lookups\|passed through" "$out/jax-shim.err" || true; status=1; }
      else
        cmp -s "$out/jax-native.txt" "$out/jax-shim.txt" && grep -q " gpu$" "$out/jax-shim.txt" &&
          grep -Eq "cudaMallocAsync, [1-9][0-9]* cuMemAlloc," "$out/jax-shim.err" &&
          ! grep -q "calls to cuMemCreate" "$out/jax-shim.err" && echo "jax: served by the shim, same output" ||
          { echo "jax: not served as claimed"; grep "served\|lookups\|passed through" "$out/jax-shim.err" || true; status=1; }
      fi
    fi
  else
    echo "LD_PRELOAD tests did not build (see preload-build.log)"
    status=1
  fi
fi

if want python; then
  echo "== PyTorch: pluggable allocator, and the shim under PYTORCH_NO_CUDA_MEMORY_CACHING=1"
  if python3 -c "import torch, torchvision, transformers" 2>/dev/null; then
    python3 examples/python/compare.py --lib "$prefix/lib/libgpupool.so" --preload "$preload" \
      --out "$out/python" 2>&1 | tee "$out/python.log" || status=1
  else
    echo "skipped: python3 lacks torch, torchvision or transformers"
  fi
fi

if want models; then
  echo "== PyTorch: models with dynamic shapes, PyTorch's allocator against gpupool's (issue 39)"
  if python3 -c "import torch, transformers" 2>/dev/null; then
    python3 examples/python/dynamic_compare.py --lib "$prefix/lib/libgpupool.so" --out "$out/models" \
      ${MODELS_WORKLOADS:+--workloads "$MODELS_WORKLOADS"} ${MODELS_ROUNDS:+--rounds "$MODELS_ROUNDS"} 2>&1 |
      tee "$out/models.log" || status=1
  else
    echo "skipped: python3 lacks torch or transformers"
  fi
fi

if want torch_sleep; then
  echo "== PyTorch: a model's pools asleep and awake (gpupool.torch.use_pool, sleep, wake)"
  if python3 -c "import torch, transformers" 2>/dev/null; then
    PYTHONPATH="$prefix/share/gpupool/python${PYTHONPATH:+:$PYTHONPATH}" python3 tests/gpu/torch_sleep.py \
      --lib "$prefix/lib/libgpupool.so" 2>&1 | tee "$out/torch_sleep.log" || status=1
  else
    echo "skipped: python3 lacks torch or transformers"
  fi
fi

if want torch_fallback; then
  echo "== PyTorch: fallback and unsplit pools (gpupool.Pool(use_on_oom=True), no_split=True)"
  if python3 -c "import torch" 2>/dev/null; then
    # Out of memory prints gpupool's message once a request (PyTorch gets NULL, docs/pytorch.md).
    PYTHONPATH="$prefix/share/gpupool/python${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 tests/gpu/torch_fallback.py \
      --lib "$prefix/lib/libgpupool.so" 2>&1 | grep -v "^gpupool: out of memory: gpupool_torch_malloc" |
      tee "$out/torch_fallback.log" || status=1
  else
    echo "skipped: python3 lacks torch"
  fi
fi

if want graphs; then
  echo "== PyTorch: torch.cuda.graph on gpupool's private pools"
  if python3 -c "import torch" 2>/dev/null; then
    python3 examples/python/graphs.py --lib "$prefix/lib/libgpupool.so" --out "$out/torch_graphs" 2>&1 |
      tee "$out/torch_graphs.log" || status=1
  else
    echo "skipped: python3 lacks torch"
  fi
fi

# New traces from models with dynamic shapes (record_trace.py says which), recorded through
# PyTorch's pluggable-allocator interface, with PyTorch's own peaks beside them; gzipped into
# OUT/traces with their table (traces.md) and the children's logs.
if want traces; then
  echo "== traces: recorded from models with dynamic shapes"
  if python3 -c "import torch, transformers" 2>/dev/null; then
    rm -rf build-gpu/traces
    python3 examples/python/record_trace.py --out build-gpu/traces ${RECORD_WORKLOADS:+--workloads "$RECORD_WORKLOADS"} 2>&1 | tee "$out/traces.log" || status=1
    mkdir -p "$out/traces"
    find build-gpu/traces -maxdepth 1 \( -name '*.txt.gz' -o -name '*.md' -o -name '*.log' -o -name '*.json' \) \
      -exec cp {} "$out/traces/" \;
  else
    echo "skipped: python3 lacks torch or transformers"
  fi
fi

# JAX (XLA) with its allocators, and with XLA_PYTHON_CLIENT_ALLOCATOR=platform under the shim:
# the same results bit for bit (XLA's choices made deterministic), the time and the device's peak
# use; OUT/jax.log.
if want jax; then
  echo "== jax: XLA's allocators and the shim"
  if python3 -c "import jax" 2>/dev/null; then
    export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true"
    : >"$out/jax.log"
    novmm="$XLA_FLAGS --xla_gpu_experimental_vmm_disabled=true"
    runs="bfc cuda_async platform shim platform-novmm shim-novmm platform-again shim-novmm-again"
    # jaxlib before 0.12 has no switch off its virtual memory calls: its runs without them go.
    probe=$(XLA_FLAGS="$novmm" python3 -c "import jax; jax.devices()" 2>&1 || true)
    if grep -q "Unknown flag in XLA_FLAGS" <<<"$probe"; then
      echo "this XLA has no --xla_gpu_experimental_vmm_disabled (jaxlib 0.12 added it): no novmm runs" >>"$out/jax.log"
      runs="bfc cuda_async platform shim platform-again shim-again"
    fi
    for run in $runs; do
      case $run in
        bfc) env=() ;;
        cuda_async) env=(XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async XLA_PYTHON_CLIENT_PREALLOCATE=false) ;;
        platform-novmm*) env=(XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="$novmm") ;;
        platform*) env=(XLA_PYTHON_CLIENT_ALLOCATOR=platform) ;;
        shim-novmm*) env=(XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="$novmm" LD_PRELOAD="$preload" GPUPOOL_PRELOAD_STATS=1) ;;
        shim*) env=(XLA_PYTHON_CLIENT_ALLOCATOR=platform LD_PRELOAD="$preload" GPUPOOL_PRELOAD_STATS=1) ;;
      esac
      echo "-- $run: ${env[*]}" >>"$out/jax.log"
      env "${env[@]}" python3 examples/python/jax_workload.py >"build-gpu/jax-$run.txt" 2>"build-gpu/jax-$run.err" || status=1
      grep -v "^result:" "build-gpu/jax-$run.txt" >>"$out/jax.log" || true
      grep -E "served|passed through|lookups|peak|reserved" "build-gpu/jax-$run.err" >>"$out/jax.log" || true
      # Whether XLA's buffers reached the shim: its virtual memory calls pass through, counted.
      case $run in
        shim-novmm*)
          grep -q "calls to cuMemCreate" "build-gpu/jax-$run.err" &&
            echo "$run: XLA still called cuMemCreate: those buffers were not gpupool's" >>"$out/jax.log" ||
            echo "$run: no cuMemCreate passed through: XLA's buffers went to cuMemAlloc" >>"$out/jax.log"
          ;;
      esac
      if [ "$run" != bfc ]; then
        cmp -s <(grep "^result:" build-gpu/jax-bfc.txt) <(grep "^result:" "build-gpu/jax-$run.txt") &&
          echo "$run: results identical to bfc" >>"$out/jax.log" ||
          { echo "$run: results DIFFER from bfc" >>"$out/jax.log"; tail -3 "build-gpu/jax-$run.err" >>"$out/jax.log"; status=1; }
      fi
    done
    unset XLA_FLAGS
    cat "$out/jax.log"
  else
    echo "skipped: no jax"
  fi
fi

# The same model under both allocators with the history recorded, the two snapshots checked
# against each other's keys, and each rendered with PyTorch's own viewer; the pickles and the
# HTML pages go to OUT/snapshot (the pages load the viewer's script from the web when opened).
if want snapshot; then
  echo "== snapshot: PyTorch's memory viewer on PyTorch's allocator and on gpupool"
  if python3 -c "import torch, torchvision" 2>/dev/null; then
    mkdir -p "$out/snapshot"
    python3 examples/python/dump_snapshot.py --lib "$prefix/lib/libgpupool.so" --out "$out/snapshot" 2>&1 |
      tee "$out/snapshot.log" || status=1
    # Annotated snapshots (issue 43): metadata, an annotated tensor, 100,000 events, the dump's
    # time with and without traces, PyTorch's _memory_viz reading the annotation.
    python3 examples/python/annotated_snapshot.py --lib "$prefix/lib/libgpupool.so" --out "$out/snapshot" 2>&1 |
      tee -a "$out/snapshot.log" || status=1
    # The C++ engine of examples/cpp (the examples section builds it), with its history.
    if [ -x build-gpu/cpp/engine ]; then
      GPUPOOL_RECORD_HISTORY=100000:alloc ./build-gpu/cpp/engine 200 4 "$out/snapshot/engine.pickle" 2>&1 |
        tee -a "$out/snapshot.log" || status=1
    else
      echo "engine not built (run the examples section first): no engine snapshot"
    fi
    for f in "$out"/snapshot/*.pickle; do
      [ -e "$f" ] || continue
      for plot in trace_plot segment_plot; do
        html="${f%.pickle}-${plot}.html"
        if python3 -m torch.cuda._memory_viz "$plot" "$f" -o "$html" >>"$out/snapshot.log" 2>&1 && [ -s "$html" ]; then
          echo "rendered $(basename "$html") ($(wc -c <"$html") bytes)"
        else
          echo "$plot failed on $(basename "$f") (see snapshot.log)"
          status=1
        fi
      done
    done
  else
    echo "skipped: python3 lacks torch or torchvision"
  fi
fi

# Python frames in the history: what they cost per allocation under each allocator, and
# whether PyTorch's viewer shows gpupool's (examples/python/frames_cost.py).
if want frames; then
  echo "== frames: Python frames in the allocation history, PyTorch's and gpupool's"
  if python3 -c "import torch" 2>/dev/null; then
    mkdir -p "$out/frames"
    python3 examples/python/frames_cost.py --torch --lib "$prefix/lib/libgpupool.so" --out "$out/frames" 2>&1 |
      tee "$out/frames.log" || status=1
  else
    echo "skipped: python3 lacks torch"
  fi
fi

if want bench; then
  echo "== benchmark"
  build_examples
  traces=()
  for t in "$dir"/traces/*.txt.gz build-gpu/traces/*.txt.gz; do
    [ -e "$t" ] || continue
    gunzip -c "$t" >"build-gpu/$(basename "$t" .gz)"
    traces+=("build-gpu/$(basename "$t" .gz)")
  done
  ./build-gpu/examples/bench "${traces[@]}" 2>&1 | tee "$out/bench.log" || status=1
fi
# Threads on one device against a device each, on the simulated device: what the threads of
# one device share (its peak credit) beside nothing shared; the library before a change too,
# when DIR/base holds it, found through LD_LIBRARY_PATH ahead of the prefix.
if want threads; then
  echo "== thread_scaling on the simulated device"
  build_examples
  runs=new
  [ -e "$dir/base/libgpupool.so" ] && runs="base new base new"
  : >"$out/threads.log"
  if [ -x build-gpu/examples/thread_scaling ]; then
    for run in $runs; do
      libs=$([ "$run" = base ] && (cd "$dir/base" && pwd) || echo "$prefix/lib")
      echo "-- $run: $(LD_LIBRARY_PATH="$libs" ldd build-gpu/examples/thread_scaling | grep gpupool)" | tee -a "$out/threads.log"
      for t in 1 4 8 16; do
        for d in 1 "$t"; do
          if [ "$d" = 1 ] || [ "$t" != 1 ]; then
            GPUPOOL_DRIVER=sim GPUPOOL_SIM_DEVICES=16 GPUPOOL_SIM_CAPACITY=16GiB LD_LIBRARY_PATH="$libs" \
              ./build-gpu/examples/thread_scaling "$t" "$d" 2>&1 | tee -a "$out/threads.log" || status=1
          fi
        done
      done
    done
  else
    echo "thread_scaling did not build (see examples-build.log)"
    status=1
  fi
fi
# The main table against the library before a change, alternating, in one session: the
# library is found through LD_LIBRARY_PATH ahead of the prefix (bench's RUNPATH), and ldd
# says which one each run loaded.
if want ab; then
  echo "== bench, base library against this one"
  build_examples
  traces=()
  for t in "$dir"/traces/*.txt.gz; do
    gunzip -c "$t" >"build-gpu/$(basename "$t" .gz)"
    traces+=("build-gpu/$(basename "$t" .gz)")
  done
  if [ -e "$dir/base/libgpupool.so" ]; then
    base=$(cd "$dir/base" && pwd)
    i=0
    for run in base new base new; do
      i=$((i + 1))
      libs=$([ "$run" = base ] && echo "$base" || echo "$prefix/lib")
      log="$out/ab-$i-$run.log"
      LD_LIBRARY_PATH="$libs" ldd ./build-gpu/examples/bench | grep gpupool | tee "$log"
      LD_LIBRARY_PATH="$libs" BENCH_ONLY=main ./build-gpu/examples/bench "${traces[@]}" >>"$log" 2>&1 || status=1
      grep -E "^\| (cache hit|16 threads|replay|random)" "$log" || true
    done
  else
    echo "no $dir/base/libgpupool.so: scripts/gpu.sh prepare-base REV puts the library before a change there"
    status=1
  fi
fi
# The replay tool on the GPU (CUDA streams made for the trace's), then on the simulated device
# of this machine, with the same configurations: what the simulated device predicts beside what
# the GPU does.
if want replay; then
  echo "== gpupool-replay"
  trace="$dir/traces/llama_decode.txt.gz"
  if [ -e "$trace" ]; then
    for driver in cuda sim; do
      for format in table json; do
        "$prefix/bin/gpupool-replay" --driver "$driver" --format "$format" \
          --conf expandable_segments:False "$trace" >"$out/replay-$driver.$format" 2>"$out/replay-$driver.err" ||
          { echo "gpupool-replay --driver $driver failed:"; cat "$out/replay-$driver.err"; status=1; }
      done
      cat "$out/replay-$driver.table"
    done
  else
    echo "no $trace: scripts/gpu.sh prepare copies ../shared/traces there"
    status=1
  fi
fi
# Pinned host memory: the GPU test, then the benchmark, built in a folder of its own with
# PyTorch's host allocator when that builds, without it otherwise.
if want host; then
  echo "== pinned host memory"
  if cmake -S tests/gpu -B build-gpu/gpu -DCMAKE_PREFIX_PATH="$prefix" >>"$out/gpu-tests-build.log" 2>&1; then
    run_gpu_test test_host host-tests.log
  else
    echo "GPU tests did not configure (see gpu-tests-build.log)"
    status=1
  fi
  torch_dir=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
  hb=build-gpu/examples-host
  if ! { build_against_prefix examples/c $hb -DGPUPOOL_TORCH_DIR="$torch_dir" -DGPUPOOL_BENCH_HOST_TORCH=ON &&
    cmake --build $hb --target bench_host; } >"$out/bench-host-build.log" 2>&1; then
    echo "bench_host with PyTorch did not build (see bench-host-build.log); building it without"
    rm -rf $hb
    { build_against_prefix examples/c $hb && cmake --build $hb --target bench_host; } >>"$out/bench-host-build.log" 2>&1 ||
      { echo "bench_host did not build (see bench-host-build.log)"; status=1; }
  fi
  if [ -x $hb/bench_host ]; then
    ./$hb/bench_host 2>&1 | tee "$out/bench-host.log" || status=1
    # With DIR/base/libgpupool.so, the hit pairs of the library before a change against this
    # one, alternating, each run's library named by ldd (as `ab` does for the device).
    if [ -e "$dir/base/libgpupool.so" ]; then
      base=$(cd "$dir/base" && pwd)
      for run in base new base new; do
        libs=$([ "$run" = base ] && echo "$base" || echo "$prefix/lib")
        { echo "-- $run: $(LD_LIBRARY_PATH="$libs" ldd ./$hb/bench_host | grep gpupool)"
          LD_LIBRARY_PATH="$libs" ./$hb/bench_host 2>&1 | grep -E "^\| (workload|allocate)"; } | tee -a "$out/bench-host-ab.log" || status=1
      done
    fi
  fi
fi
# The Python package and the frameworks' allocator plug-ins, each against the framework's own
# allocator in separate processes (tests/gpu/plugins.py says what each check requires).
if want plugins; then
  echo "== plugins: the gpupool package under CuPy, Numba, PyTorch and ONNX Runtime"
  pydir=build-gpu/python
  rm -rf "$pydir"
  wheel=$(ls "$dir"/wheels/gpupool-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$wheel" ] && python3 -m pip install --no-deps --no-index --target "$pydir" "$wheel" >"$out/plugins-install.log" 2>&1; then
    echo "the package from $(basename "$wheel")"
  else
    pydir="$prefix/share/gpupool/python"
    echo "no wheel in $dir/wheels (or it did not install): the package from $pydir"
  fi
  PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}" python3 tests/gpu/plugins.py --out "$out" 2>&1 |
    tee "$out/plugins.log" || status=1
  # RMM: gpupool_rmm.hpp as RMM's current device resource under rmm::device_buffer.
  rmm_wheel=$(ls "$dir"/wheels/librmm_cu13-*.whl 2>/dev/null | head -1 || true)
  logger_wheel=$(ls "$dir"/wheels/rapids_logger-*.whl 2>/dev/null | head -1 || true)
  if [ -n "$rmm_wheel" ] && [ -n "$logger_wheel" ]; then
    r=build-gpu/rmm
    rm -rf $r && mkdir -p $r
    python3 -m zipfile -e "$rmm_wheel" $r && python3 -m zipfile -e "$logger_wheel" $r
    if command -v nvcc >/dev/null 2>&1; then cuda_home=$(dirname "$(dirname "$(command -v nvcc)")"); else cuda_home=${CUDA_HOME:-/usr/local/cuda}; fi
    if c++ -std=c++17 -I$r/librmm/include -I$r/librmm/include/rapids -I"$cuda_home/include" -I"$prefix/include" \
      tests/rmm/test_rmm_gpu.cpp -o $r/test_rmm_gpu -L"$prefix/lib" -lgpupool -L$r/librmm/lib64 -lrmm \
      -L$r/rapids_logger/lib64 -lrapids_logger -L"$cuda_home/lib64" -lcudart \
      -Wl,-rpath,"$prefix/lib:$PWD/$r/librmm/lib64:$PWD/$r/rapids_logger/lib64:$cuda_home/lib64" >"$out/rmm-build.log" 2>&1; then
      ./$r/test_rmm_gpu 2>&1 | tee "$out/rmm.log" || status=1
    else
      echo "tests/rmm/test_rmm_gpu.cpp did not build (see rmm-build.log)"
      status=1
    fi
  else
    echo "RMM skipped: no librmm wheel in $dir/wheels (scripts/gpu.sh prepare downloads it)"
  fi
fi

# CuPy's mixed workload under CuPy's pool and gpupool's two routes (issue 41).
if want cupy; then
  echo "== cupy: a mixed CuPy workload on three streams, CuPy's pool against gpupool"
  pydir=build-gpu/python-cupy
  rm -rf "$pydir"
  wheel=$(ls "$dir"/wheels/gpupool-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ] || ! python3 -m pip install --no-deps --no-index --target "$pydir" "$wheel" >"$out/cupy-install.log" 2>&1; then
    pydir="$prefix/share/gpupool/python"
  fi
  PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}" python3 examples/python/cupy_mixed.py \
    --reps "${CUPY_MIXED_REPS:-5}" --out "$out" 2>&1 | tee "$out/cupy_mixed.log" || status=1
fi

if want nccl; then
  echo "== nccl: segments registered with NCCL through a segment observer"
  if command -v nvcc >/dev/null 2>&1; then cuda_home=$(dirname "$(dirname "$(command -v nvcc)")"); else cuda_home=${CUDA_HOME:-/usr/local/cuda}; fi
  nccl_inc=""
  for d in "$cuda_home/include" /usr/include \
    "$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"include"))' 2>/dev/null)" \
    "$(python3 -c 'import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],"include"))' 2>/dev/null)"; do
    if [ -n "$d" ] && [ -f "$d/nccl.h" ]; then nccl_inc=$d; break; fi
  done
  nccl_lib=/usr/lib/x86_64-linux-gnu/libnccl.so.2
  n=build-gpu/nccl
  mkdir -p $n
  if [ -z "$nccl_inc" ] || [ ! -f "$nccl_lib" ]; then
    echo "nccl: nccl.h (${nccl_inc:-not found}) or $nccl_lib missing"
    status=1
  elif c++ -std=c++17 -Wall -Wextra -I"$prefix/include" -I"$nccl_inc" -I"$cuda_home/include" \
    examples/cpp/nccl_register.cpp -o $n/nccl_register -pthread -L"$prefix/lib" -lgpupool "$nccl_lib" \
    -L"$cuda_home/lib64" -lcudart -Wl,-rpath,"$prefix/lib:$cuda_home/lib64" >"$out/nccl-build.log" 2>&1; then
    echo "nccl.h from $nccl_inc"
    ./$n/nccl_register 2>&1 | tee "$out/nccl-expandable.log" || status=1
    GPUPOOL_CONF=expandable_segments:False ./$n/nccl_register 2>&1 | tee "$out/nccl-ordinary.log" || status=1
  else
    echo "examples/cpp/nccl_register.cpp did not build (see nccl-build.log)"
    status=1
  fi
fi
if want llama; then
  source scripts/gpu_llama.sh
fi
exit $status
