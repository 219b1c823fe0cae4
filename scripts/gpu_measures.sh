# Sourced by scripts/gpu.sh run: the sections snapshot, frames, bench, threads, ab, replay,
# host, plugins, cupy and nccl (gpu.sh's opening comment says what each runs). Uses gpu.sh's
# want, out, dir, prefix, status, build_against_prefix and build_examples.

# The same model under both allocators with the history recorded, the two snapshots checked
# against each other's keys, and each rendered with PyTorch's own viewer; the pickles and the
# HTML pages go to OUT/snapshot (the pages load the viewer's script from the web when opened).
if want snapshot; then
  echo "== snapshot: PyTorch's memory viewer on PyTorch's allocator and on gpupool"
  if python_has torch torchvision; then
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
  fi
fi

# Python frames in the history: what they cost per allocation under each allocator, and
# whether PyTorch's viewer shows gpupool's (examples/python/frames_cost.py).
if want frames; then
  echo "== frames: Python frames in the allocation history, PyTorch's and gpupool's"
  if python_has torch; then
    mkdir -p "$out/frames"
    python3 examples/python/frames_cost.py --torch --lib "$prefix/lib/libgpupool.so" --out "$out/frames" 2>&1 |
      tee "$out/frames.log" || status=1
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
    lscpu 2>&1 | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|CPU\(s\)|CPU max MHz)" |
      tee -a "$out/threads.log" || true
    # The host's control first (no gpupool call): what its cores give work that shares nothing.
    for round in 1 2; do
      for t in 1 4 8 16; do
        ./build-gpu/examples/thread_scaling "$t" 0 2>&1 | tee -a "$out/threads.log" || status=1
      done
    done
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
