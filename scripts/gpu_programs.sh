# Sourced by scripts/gpu.sh run: the sections examples, preload, python, models, torch_sleep,
# torch_fallback, graphs (its Python half), traces and jax (gpu.sh's opening comment says what
# each runs). Uses gpu.sh's want, out, prefix, status and build_against_prefix.

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
    # Its stream, on which gpupool served and freed a block, is destroyed with cuStreamDestroy:
    # the shim waits for it first (preload/src/streams.rs). app's two streams held nothing of
    # gpupool's (its cudaMalloc is the legacy stream's): shown, not required.
    grep -q "retired 1 streams before their destroy: waited for 1, 0 failed" "$out/driver-shim.err" &&
      echo "driver_app: its stream destroy retired as claimed" ||
      { echo "driver_app: stream destroy not retired as claimed"; grep retired "$out/driver-shim.err" || true; status=1; }
    echo "app: $(grep -o "retired .*" "$out/app-shim.err" || echo "no stream destroys retired")"
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
  if python_has torch torchvision transformers; then
    python3 examples/python/compare.py --lib "$prefix/lib/libgpupool.so" --preload "$preload" \
      --out "$out/python" 2>&1 | tee "$out/python.log" || status=1
  fi
fi

if want models; then
  echo "== PyTorch: models with dynamic shapes, PyTorch's allocator against gpupool's (issue 39)"
  if python_has torch transformers; then
    python3 examples/python/dynamic_compare.py --lib "$prefix/lib/libgpupool.so" --out "$out/models" \
      ${MODELS_WORKLOADS:+--workloads "$MODELS_WORKLOADS"} ${MODELS_ROUNDS:+--rounds "$MODELS_ROUNDS"} \
      ${MODELS_CONFIGS:+--configs "$MODELS_CONFIGS"} 2>&1 |
      tee "$out/models.log" || status=1
  fi
fi

if want torch_sleep; then
  echo "== PyTorch: a model's pools asleep and awake (gpupool.torch.use_pool, sleep, wake)"
  if python_has torch transformers; then
    PYTHONPATH="$prefix/share/gpupool/python${PYTHONPATH:+:$PYTHONPATH}" python3 tests/gpu/torch_sleep.py \
      --lib "$prefix/lib/libgpupool.so" 2>&1 | tee "$out/torch_sleep.log" || status=1
  fi
fi

if want torch_fallback; then
  echo "== PyTorch: fallback and unsplit pools (gpupool.Pool(use_on_oom=True), no_split=True)"
  if python_has torch; then
    # Out of memory prints gpupool's message once a request (PyTorch gets NULL, docs/pytorch.md).
    PYTHONPATH="$prefix/share/gpupool/python${PYTHONPATH:+:$PYTHONPATH}" timeout 300 python3 tests/gpu/torch_fallback.py \
      --lib "$prefix/lib/libgpupool.so" 2>&1 | grep -v "^gpupool: out of memory: gpupool_torch_malloc" |
      tee "$out/torch_fallback.log" || status=1
  fi
fi

if want graphs; then
  echo "== PyTorch: torch.cuda.graph on gpupool's private pools"
  if python_has torch; then
    python3 examples/python/graphs.py --lib "$prefix/lib/libgpupool.so" --out "$out/torch_graphs" 2>&1 |
      tee "$out/torch_graphs.log" || status=1
  fi
fi

# New traces from models with dynamic shapes (record_trace.py says which), recorded through
# PyTorch's pluggable-allocator interface, with PyTorch's own peaks beside them; gzipped into
# OUT/traces with their table (traces.md) and the children's logs.
if want traces; then
  echo "== traces: recorded from models with dynamic shapes"
  if python_has torch transformers; then
    rm -rf build-gpu/traces
    python3 examples/python/record_trace.py --out build-gpu/traces ${RECORD_WORKLOADS:+--workloads "$RECORD_WORKLOADS"} 2>&1 | tee "$out/traces.log" || status=1
    mkdir -p "$out/traces"
    find build-gpu/traces -maxdepth 1 \( -name '*.txt.gz' -o -name '*.md' -o -name '*.log' -o -name '*.json' \) \
      -exec cp {} "$out/traces/" \;
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

