# The `llama` section of scripts/gpu.sh (sourced by it, with $dir, $out, $prefix, $preload and
# $status set): llama.cpp's CUDA backend without and under the LD_PRELOAD shim, with each of
# ggml's two memory pools. Needs DIR/llama.tar.gz and DIR/gguf-*.whl (scripts/llama_src.sh makes
# both where there is network) and nvcc; no network, no pip.
#
# 1. llama.cpp unpacked into build-gpu/llama and built with CUDA for sm_90 (libllama and ggml
#    only: no tools, examples, tests, common; flash attention kernels off, GGML_CUDA_FA=OFF),
#    while ggml-cuda.cu is compiled a second time with GGML_CUDA_NO_VMM beside the build; that
#    object, linked with the build's other objects, is the legacy pool's libggml-cuda.so
#    (scripts/relink_with_define.py), found first through LD_LIBRARY_PATH. Incremental: a second
#    run after a timeout goes on where the first stopped.
# 2. examples/cpp/llama_greedy.cpp built against libllama; examples/python/llama_random_gguf.py
#    writes the model (random weights, seed 0; the gguf wheel on PYTHONPATH).
# 3. For each pool (vmm: ggml's default, cuMemCreate/cuMemMap itself; legacy: cudaMalloc), greedy
#    generation of LLAMA_TOKENS tokens (default 256) at a context of 4096 with every layer on
#    the GPU, without the shim and under it (GPUPOOL_PRELOAD_STATS=1, GPUPOOL_RECORD_HISTORY,
#    GPUPOOL_SNAPSHOT_AT_EXIT). Required: the same token ids in all four runs, and each snapshot
#    a pickle with PyTorch's keys (segments, device_traces). Reported: prompt and generation
#    tokens/s, the process's peak device memory (nvidia-smi, sampled every 20 ms), ggml's
#    buffers, what the shim served and its memory summary.
# OUT/llama.log: the summary; OUT/llama-runs.log: the build's output and every run's stderr;
# OUT/llama-vmm.pickle, OUT/llama-legacy.pickle: the snapshots under the shim.
#
# LLAMA_CPU_DRY_RUN=1 tries the section's steps where there is no GPU: llama.cpp built for the CPU
# (in build-gpu/llama-dry, LLAMA_JOBS jobs, default 1), the "legacy" library ggml-cpu with
# ggml-cpu.c compiled again with a define that changes nothing, no layer offloaded, no nvidia-smi;
# the shim then serves nothing (no CUDA call), so the checks of what it served and of the
# snapshots fail there, as they must.
llama_section() {
  echo "== llama: llama.cpp's CUDA backend (both pools) without and under the LD_PRELOAD shim"
  local l=build-gpu/llama log="$out/llama.log" runs="$out/llama-runs.log"
  local tarball="$dir/llama.tar.gz" wheel cuda_home t0
  # What differs in a dry run on the CPU: the backend, the library built twice, the source and
  # define of its second build, the jobs, the layers offloaded.
  local backend=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF) target=ggml-cuda
  local source=ggml-cuda/ggml-cuda.cu define=GGML_CUDA_NO_VMM jobs=15 ngl=99
  if [ "${LLAMA_CPU_DRY_RUN:-0}" = 1 ]; then
    l=build-gpu/llama-dry backend=(-DGGML_CUDA=OFF) target=ggml-cpu source=ggml-cpu/ggml-cpu.c
    define=GGML_DRY_RUN_RELINK jobs=${LLAMA_JOBS:-1} ngl=0
  fi
  : >"$log"
  : >"$runs"
  wheel=$(ls "$dir"/gguf-*.whl 2>/dev/null | head -1 || true)
  if [ ! -f "$tarball" ] || [ -z "$wheel" ]; then
    echo "no $tarball or $dir/gguf-*.whl: scripts/llama_src.sh makes them" | tee -a "$log"
    status=1
    return
  fi
  wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
  if command -v nvcc >/dev/null 2>&1; then cuda_home=$(dirname "$(dirname "$(command -v nvcc)")"); else cuda_home=${CUDA_HOME:-/usr/local/cuda}; fi
  mkdir -p $l
  if [ ! -e $l/llama.cpp/.unpacked ] || [ "$tarball" -nt $l/llama.cpp/.unpacked ]; then
    rm -rf $l/llama.cpp $l/build $l/novmm
    tar xzf "$tarball" -C $l && touch $l/llama.cpp/.unpacked
  fi
  t0=$(date +%s)
  if ! cmake -S $l/llama.cpp -B $l/build -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" \
    "${backend[@]}" -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >>"$runs" 2>&1; then
    echo "llama.cpp did not configure (see llama-runs.log)" | tee -a "$log"
    status=1
    return
  fi
  local pools="vmm legacy"
  # The legacy pool's ggml-cuda.cu beside the whole build (15 jobs and this one).
  local relink=(python3 scripts/relink_with_define.py $l/build $target $source $define $l/novmm)
  local novmm_lib=$l/novmm/lib$target.so.0 compile_pid=""
  if [ ! -e $novmm_lib ] || [ $l/llama.cpp/.unpacked -nt $novmm_lib ]; then
    "${relink[@]}" compile >$l/novmm-compile.log 2>&1 &
    compile_pid=$!
  fi
  if ! cmake --build $l/build -j"$jobs" --target llama >>"$runs" 2>&1; then
    [ -z "$compile_pid" ] || wait "$compile_pid" || true
    echo "llama.cpp did not build (see llama-runs.log)" | tee -a "$log"
    status=1
    return
  fi
  if [ -n "$compile_pid" ]; then
    if ! { wait "$compile_pid" && "${relink[@]}" link; } >>$l/novmm-compile.log 2>&1; then
      cat $l/novmm-compile.log >>"$runs"
      # The default pool's runs go on without it.
      echo "the legacy pool's libggml-cuda did not build (see llama-runs.log): the VMM pool alone" | tee -a "$log"
      status=1
      rm -f $novmm_lib
      pools=vmm
    fi
    cat $l/novmm-compile.log >>"$runs"
  fi
  echo "llama.cpp built in $(($(date +%s) - t0)) s (pools: $pools)" | tee -a "$log"
  # What each library takes from CUDA by name: what the dynamic linker can bind to the shim.
  local lib
  for lib in $l/build/bin/lib$target.so $novmm_lib; do
    echo "$lib imports: $(nm -D --undefined-only "$lib" 2>/dev/null | awk '{print $2}' |
      grep -E '^(cudaMalloc|cudaMallocHost|cudaMallocManaged|cudaFree|cuMemCreate|cuMemMap|cuMemAddressReserve)(@|$)' |
      tr '\n' ' ')" | tee -a "$log"
  done
  if ! c++ -O2 -std=c++17 -I$l/llama.cpp/include -I$l/llama.cpp/ggml/include examples/cpp/llama_greedy.cpp \
    -o $l/llama_greedy -L$l/build/bin -lllama -lggml -lggml-base -Wl,-rpath,"$PWD/$l/build/bin" >>"$runs" 2>&1; then
    echo "examples/cpp/llama_greedy.cpp did not build (see llama-runs.log)" | tee -a "$log"
    status=1
    return
  fi
  if ! PYTHONPATH="$wheel" python3 examples/python/llama_random_gguf.py $l/random.gguf 2>&1 | tee -a "$log"; then
    echo "the model was not written" | tee -a "$log"
    status=1
    return
  fi
  local pool mode name pid smi base peak peak_gpu tokens=${LLAMA_TOKENS:-256}
  for pool in $pools; do
    local libs=""
    [ $pool = legacy ] && libs="$PWD/$l/novmm"
    echo "-- $pool pool: $(LD_LIBRARY_PATH=$libs ldd $l/llama_greedy | grep -o "lib$target[^(]*")" | tee -a "$log"
    for mode in native shim; do
      name=$pool-$mode
      rm -f "$out/llama-$pool.pickle"
      # The process's device memory every 20 ms (by its pid; in a container nvidia-smi may show
      # the host's pids, so any process's when none matches), and the device's used memory above
      # what it was before the run.
      : >$l/smi-$name.txt
      : >$l/smi-gpu-$name.txt
      smi="" base=0
      if command -v nvidia-smi >/dev/null 2>&1; then
        base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 || echo 0)
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 20 >$l/smi-$name.txt 2>/dev/null &
        smi=$!
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 20 >$l/smi-gpu-$name.txt 2>/dev/null &
        smi="$smi $!"
      fi
      if [ $mode = native ]; then
        LD_LIBRARY_PATH=$libs $l/llama_greedy -m $l/random.gguf -n "$tokens" -c 4096 -ngl $ngl \
          >$l/$name.out 2>$l/$name.err &
      else
        LD_LIBRARY_PATH=$libs LD_PRELOAD="$preload" GPUPOOL_PRELOAD_STATS=1 GPUPOOL_RECORD_HISTORY=100000:alloc \
          GPUPOOL_SNAPSHOT_AT_EXIT="$out/llama-$pool.pickle" \
          $l/llama_greedy -m $l/random.gguf -n "$tokens" -c 4096 -ngl $ngl >$l/$name.out 2>$l/$name.err &
      fi
      pid=$!
      wait $pid || { echo "$name: llama_greedy failed (its stderr is in llama-runs.log)" | tee -a "$log"; status=1; }
      if [ -n "$smi" ]; then
        sleep 0.1
        kill $smi 2>/dev/null || true
        wait $smi 2>/dev/null || true
      fi
      { echo "==== $name"; cat $l/$name.err; } >>"$runs"
      peak=$(awk -F', *' -v p=$pid '$2 + 0 > any { any = $2 + 0 } $1 == p && $2 + 0 > m { m = $2 + 0 }
        END { print (m > 0 ? m : any) + 0 }' $l/smi-$name.txt || echo "?")
      peak_gpu=$(awk -v b="$base" '$1 + 0 > m { m = $1 + 0 } END { print (m > b ? m - b : 0) }' $l/smi-gpu-$name.txt || echo "?")
      echo "$name: $(grep -o 'prompt .*' $l/$name.err | tail -1 || echo 'no timings'); peak device memory: process ${peak} MiB, device ${peak_gpu} MiB over its idle use (nvidia-smi)" |
        tee -a "$log"
      grep -E "VMM: |CUDA0 (model|KV|compute) buffer|CUDA_Host (output|compute) buffer" $l/$name.err | sed 's/^/    /' >>"$log" || true
      if [ $mode = shim ]; then
        grep -E "^gpupool_preload: (served|passed|deferred|refused|CUDA lookups|pinned)|^gpupool: " $l/$name.err |
          sed 's/^/    /' | tee -a "$log" || true
        grep -A14 "memory summary, device ID 0" $l/$name.err | sed 's/^/    /' >>"$log" || true
        grep -q "served [1-9][0-9]* cudaMalloc" $l/$name.err ||
          { echo "$name: the shim served no cudaMalloc" | tee -a "$log"; status=1; }
      fi
    done
  done
  # The same tokens in every run: each pool under the shim against itself without, and the pools
  # against each other.
  local ref=$l/vmm-native.out
  local names=vmm-shim
  [ "$pools" = vmm ] || names="vmm-shim legacy-native legacy-shim"
  for name in $names; do
    if [ -s $ref ] && cmp -s $ref $l/$name.out; then
      echo "$name: the same $(head -1 $ref | wc -w | awk '{print $1 - 1}') tokens as vmm-native" | tee -a "$log"
    else
      echo "$name: tokens differ from vmm-native" | tee -a "$log"
      diff $ref $l/$name.out >>"$log" 2>&1 || true
      status=1
    fi
  done
  head -2 $ref | cut -c1-200 | sed 's/^/    /' >>"$log"
  # Each snapshot as PyTorch's viewer reads it (and rendered by it in memory, where torch is).
  for pool in $pools; do
    python3 - "$out/llama-$pool.pickle" <<'EOF' 2>&1 | tee -a "$log" || status=1
import collections, pickle, sys
path = sys.argv[1]
with open(path, "rb") as f:
    s = pickle.load(f)
missing = [k for k in ("segments", "device_traces") if k not in s]
if missing:
    sys.exit(f"{path}: not a PyTorch snapshot, no {missing}")
segs, traces = s["segments"], s["device_traces"]
events = [e for t in traces for e in t]
actions = collections.Counter(e["action"] for e in events)
sizes = sorted({e["size"] for e in events if e["action"] == "alloc"})
print(f"{path.rsplit('/', 1)[-1]}: {len(segs)} segments, {sum(g['total_size'] for g in segs) / 2**20:.1f} MiB reserved, "
      f"{sum(g['allocated_size'] for g in segs) / 2**20:.1f} MiB allocated at exit; {len(events)} events {dict(actions)}; "
      f"{len(sizes)} distinct sizes, largest {sizes[-1] / 2**20 if sizes else 0:.1f} MiB")
if not events or not actions.get("alloc"):
    sys.exit(f"{path}: no alloc event in the history")
try:
    from torch.cuda import _memory_viz
except Exception:
    print("    (no torch here: not rendered)")
else:
    print(f"    rendered by torch.cuda._memory_viz: segment_plot {len(_memory_viz.segment_plot(s))} bytes, "
          f"trace_plot {len(_memory_viz.trace_plot(s))} bytes")
EOF
  done
}
llama_section
