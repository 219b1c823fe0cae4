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
#               threads), into OUT/two-gpus.log; on any number of GPUs, tests/gpu/test_sleep_all
#               (every device's pool slept and woken at once from a thread each, pageable and
#               pinned after gpupool_sleep_prepare, GB/s against the pinned copy bandwidth of all
#               devices copying at once; GPUPOOL_SLEEP_ALL_GIB, default 4), into OUT/sleep-all.log
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
#               (default 2), MODELS_CONFIGS adding gpupool_reclaim_2mib (the high-water rule with
#               2 MiB pages): identical outputs, median pass time, peak reserved; OUT/models.log
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
#               peak settles per million calls, after lscpu's cores and the host's control (a
#               loop calling no gpupool function, 1-16 threads, twice); with
#               DIR/base/libgpupool.so there, base and this library alternating (base, new,
#               base, new), each run's library named by ldd; OUT/threads.log
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
      run_gpu_test test_sleep_all sleep-all.log
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

# Whether python3 imports each module named; where it does not, says that the section is
# skipped and why.
python_has() {
  python3 -c "import $(IFS=,; echo "$*")" 2>/dev/null && return 0
  echo "skipped: python3 lacks $*"
  return 1
}

# The examples, the LD_PRELOAD shim and the Python programs (section examples to jax), then the
# measurements and the libraries beside gpupool (snapshot to nccl); each part reads the
# variables and functions above (want, out, prefix, status, build_against_prefix).
source scripts/gpu_programs.sh
source scripts/gpu_measures.sh
if want llama; then
  source scripts/gpu_llama.sh
fi
exit $status
