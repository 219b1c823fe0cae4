"""The gpupool package's framework plug-ins on a GPU (scripts/gpu.sh's `plugins` section).

    python3 tests/gpu/plugins.py [--out DIR]

Each check runs its workload in fresh processes, once on the framework's own allocator and
once on gpupool, and requires the same results bit for bit (a SHA-256 of every result's
bytes); on gpupool it also requires that gpupool's statistics saw the framework's blocks:

- cupy        CuPy on its default stream and on two streams of its own (matrix products,
              element-wise kernels, reductions, an FFT, arrays freed and made again each
              step), through gpupool.cupy.install() (CuPy's current stream, the compiled hook:
              route() must say "hook", and the child's exit must print nothing), and again
              through install(stream=...) (the hook on one stream); every
              array's bytes in gpupool's allocated bytes while it lives; pinned memory from
              gpupool's pinned cache
- numba       a Numba kernel (saxpy and a reduction) on device arrays, with
              NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba against Numba's own manager
- together    PyTorch, CuPy and Numba on gpupool in one process: one set of statistics counts
              the blocks of all three, and empty_cache gives their cache back; arrays of all
              three alive at exit (a module's globals, a cycle), and nothing on stderr
- onnxruntime a two-node model on the CUDA execution provider with gpupool's external
              allocator, where onnxruntime has that provider (the CPU package does not: said)

Prints one line per check ("cupy: identical results ..."), then "N passed, N failed"; exits 1
when a check failed. Needs the gpupool package importable (scripts/gpu.sh puts the wheel, or
the installed prefix's copy, on PYTHONPATH).
"""

import argparse
import json
import os
import subprocess
import sys

MIB = 1 << 20


def run_child(check, allocator, extra_env=None):
    """Runs `check` in a fresh process on `allocator`; returns its JSON result."""
    env = dict(os.environ, **(extra_env or {}))
    out = subprocess.run([sys.executable, __file__, "--child", check, allocator], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{check} on {allocator} failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr  # what the child printed there, at exit too
    return result


def digest(h, array):
    h.update(array.tobytes() if hasattr(array, "tobytes") else bytes(array))


# The children -----------------------------------------------------------------------------------

def cupy_workload(cp, streams):
    """Deterministic CuPy work on each stream in `streams`; returns the SHA-256 of its results."""
    import hashlib

    h = hashlib.sha256()
    for s_index, stream in enumerate(streams):
        with stream:
            rng = cp.random.RandomState(1234 + s_index)
            acc = cp.zeros((256, 256), dtype=cp.float32)
            for step in range(30):
                n = 64 + 32 * (step % 7)  # sizes change step to step: blocks are freed and reused
                a = rng.standard_normal((n, 256), dtype=cp.float32)
                b = rng.standard_normal((256, n), dtype=cp.float32)
                c = a @ b
                acc[:n, :n] += cp.tanh(c) * 0.5
                spectrum = cp.fft.rfft(a, axis=1)
                acc[0, :n] += cp.abs(spectrum[:, :n // 2 + 1]).sum(axis=1)[:n].astype(cp.float32)
                del a, b, c, spectrum
            stream.synchronize()
            digest(h, cp.asnumpy(acc))
            digest(h, cp.asnumpy(acc.sum(axis=0)))
    return h.hexdigest()


def child_cupy(allocator):
    import cupy as cp
    import numpy as np

    result = {}
    # cupy and gpupool: the null stream and two of CuPy's own; cupy-one-stream and
    # gpupool-fixed-stream: one stream of CuPy's own, the latter given to install(stream=...).
    if allocator in ("cupy", "gpupool"):
        streams = [cp.cuda.Stream.null, cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)]
    else:
        streams = [cp.cuda.Stream(non_blocking=True)]
    if allocator == "gpupool":
        import gpupool

        gpupool.cupy.install()
        result["route"] = gpupool.cupy.route()
    elif allocator == "gpupool-fixed-stream":
        import gpupool

        gpupool.cupy.install(stream=streams[0])
    result["sha256"] = cupy_workload(cp, streams)
    if allocator.startswith("gpupool"):
        s = gpupool.stats(0)
        result["allocations"] = s["allocation.all.allocated"]
        result["peak_mib"] = s["allocated_bytes.all.peak"] / MIB
        # One array's bytes, rounded as gpupool rounds (512), in the allocated bytes while it lives.
        before = gpupool.stats(0)["allocated_bytes.all.current"]
        x = cp.ones(1_000_003, dtype=cp.uint8)
        during = gpupool.stats(0)["allocated_bytes.all.current"]
        del x
        after = gpupool.stats(0)["allocated_bytes.all.current"]
        result["array_delta"] = during - before
        result["array_seen"] = (during - before == 1_000_448) and after == before
        # Pinned memory.
        host_before = gpupool.host_stats()["active_requests.current"]
        pinned = cp.cuda.alloc_pinned_memory(1 << 20)
        result["pinned_seen"] = gpupool.host_stats()["active_requests.current"] == host_before + 1
        host = np.frombuffer(pinned, dtype=np.uint8, count=1 << 20)
        host[:] = 5
        result["pinned_copy"] = int(cp.asarray(host).sum()) == 5 << 20
        del host, pinned
    print(json.dumps(result))


def child_numba(allocator):
    import hashlib

    import numpy as np
    from numba import cuda

    @cuda.jit
    def saxpy(a, x, y, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a * x[i] + y[i]

    @cuda.jit
    def block_sums(x, out):
        i = cuda.grid(1)
        if i < x.size:
            cuda.atomic.add(out, i % out.size, x[i])

    h = hashlib.sha256()
    rng = np.random.default_rng(7)
    # numba-cuda may not compile kernels at all where its numpy is newer than it supports
    # (the GPU machine of 2026-11-27: numba-cuda's arrayobj needs np.row_stack, gone in
    # numpy 2.4): then the same arrays move by device-to-device copies instead, which still
    # allocate every buffer through the memory manager under test.
    kernels = True
    for step in range(20):
        n = 100_000 + 50_000 * (step % 5)
        x = cuda.to_device(rng.standard_normal(n).astype(np.float32))
        y = cuda.to_device(rng.standard_normal(n).astype(np.float32))
        out = cuda.device_array(n, dtype=np.float32)
        sums = cuda.to_device(np.zeros(64, dtype=np.int64))
        if kernels:
            try:
                saxpy[(n + 255) // 256, 256](np.float32(2.5), x, y, out)
                block_sums[(n + 255) // 256, 256](cuda.to_device(np.arange(n, dtype=np.int64)), sums)
            except AttributeError as e:
                print(f"numba: kernels do not compile here ({e}); device copies only", file=sys.stderr)
                kernels = False
        if not kernels:
            out.copy_to_device(x)
            staged = cuda.device_array(n, dtype=np.float32)
            staged.copy_to_device(y)
            digest(h, staged.copy_to_host())
            sums.copy_to_device(np.arange(64, dtype=np.int64))
        digest(h, out.copy_to_host())
        digest(h, sums.copy_to_host())
        del x, y, out, sums
    pinned = cuda.pinned_array(4096, dtype=np.float32)
    pinned[:] = 1.5
    digest(h, cuda.to_device(pinned).copy_to_host())
    result = {"sha256": h.hexdigest(), "kernels": kernels}
    if allocator == "gpupool":
        import gpupool
        from numba.cuda.cudadrv import driver

        result["manager"] = driver._memory_manager.__name__
        s = gpupool.stats(0)
        result["allocations"] = s["allocation.all.allocated"]
        result["host_allocations"] = gpupool.host_stats()["num_host_alloc"]
    print(json.dumps(result))


def child_together(_allocator):
    import cupy as cp
    import numpy as np
    import torch
    from numba import cuda

    import gpupool

    gpupool.torch.install()
    gpupool.cupy.install()
    cuda.set_memory_manager(gpupool.numba.GpupoolNumbaManager)
    base = gpupool.stats(0)["allocated_bytes.all.current"]
    t = torch.ones(8 * MIB // 4, device="cuda")
    c = cp.ones(4 * MIB // 4, dtype=cp.float32)
    n = cuda.to_device(np.ones(2 * MIB // 4, dtype=np.float32))
    s = gpupool.stats(0)
    result = {
        "allocated_mib": (s["allocated_bytes.all.current"] - base) / MIB,
        "sum": float(t.sum().item()) + float(c.sum()) + float(n.copy_to_host().sum()),
    }
    del t, c, n
    import gc

    gc.collect()
    torch.cuda.synchronize()
    result["after_free_mib"] = (gpupool.stats(0)["allocated_bytes.all.current"] - base) / MIB
    gpupool.empty_cache(0)
    result["reserved_after_empty_cache_mib"] = gpupool.stats(0)["reserved_bytes.all.current"] / MIB
    # Alive at exit, in a module's globals and in a reference cycle: freed by the teardown.
    gpupool._kept_at_exit = [torch.ones(1000, device="cuda"), cp.ones(1000), cuda.to_device(np.ones(1000))]
    cycle = {"arrays": [torch.zeros(3000, device="cuda"), cp.zeros(3000)]}
    cycle["self"] = cycle
    print(json.dumps(result))


def child_onnxruntime(allocator):
    import numpy as np
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(json.dumps({"skipped": f"onnxruntime {ort.__version__} has no CUDAExecutionProvider"}))
        return
    from onnx import TensorProto, helper
    rng = np.random.default_rng(3)
    w = rng.standard_normal((512, 512)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 512])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 512])],
        [helper.make_tensor("w", TensorProto.FLOAT, [512, 512], w.flatten())])
    model = helper.make_model(graph).SerializeToString()
    options = {}
    if allocator == "gpupool":
        import gpupool

        options = gpupool.onnxruntime.provider_options()
    session = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", options)])
    import hashlib

    h = hashlib.sha256()
    for batch in (1, 64, 7, 256):
        digest(h, session.run(None, {"x": rng.standard_normal((batch, 512)).astype(np.float32)})[0])
    result = {"sha256": h.hexdigest()}
    if allocator == "gpupool":
        result["allocations"] = gpupool.stats(0)["allocation.all.allocated"]
    print(json.dumps(result))


# The parent ---------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        check, allocator = args.child
        globals()[f"child_{check}"](allocator)
        return 0
    passed = failed = 0
    lines = []

    def report(ok, line):
        nonlocal passed, failed
        passed, failed = passed + bool(ok), failed + (not ok)
        lines.append(line)
        print(line, flush=True)

    def attempt(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (one check's failure does not stop the others)
            report(False, f"{name}: FAILED: {e}")

    def cupy_check():
        own, ours = run_child("cupy", "cupy"), run_child("cupy", "gpupool")
        ok = own["sha256"] == ours["sha256"] and ours["allocations"] > 0 and ours["array_seen"]
        report(ours["route"] == "hook", f"cupy route: {ours['route']} (the compiled hook, 'hook', expected)")
        # Arrays (and cuFFT plans' work areas) alive at exit go back without a word.
        report(not ours["stderr"], f"cupy exit: {'silent' if not ours['stderr'] else 'NOT silent: ' + ours['stderr'][-300:]}")
        report(ok, f"cupy (current stream, 3 streams): {'identical' if own['sha256'] == ours['sha256'] else 'DIFFERENT'} "
                   f"results under CuPy's pool and gpupool ({ours['sha256'][:16]}); gpupool served "
                   f"{ours['allocations']} allocations, peak {ours['peak_mib']:.1f} MiB; a 1,000,003-byte array "
                   f"{'seen' if ours['array_seen'] else 'NOT seen'} in gpupool's statistics "
                   f"(+{ours['array_delta']} bytes, 1,000,448 expected)")
        report(ours["pinned_seen"] and ours["pinned_copy"],
               f"cupy pinned memory: from gpupool's pinned cache {'yes' if ours['pinned_seen'] else 'NO'}, "
               f"copy to the device {'right' if ours['pinned_copy'] else 'WRONG'}")
        own1, fixed = run_child("cupy", "cupy-one-stream"), run_child("cupy", "gpupool-fixed-stream")
        report(own1["sha256"] == fixed["sha256"] and fixed["allocations"] > 0,
               f"cupy (install(stream=s), C functions): {'identical' if own1['sha256'] == fixed['sha256'] else 'DIFFERENT'} "
               f"results; gpupool served {fixed['allocations']} allocations")

    def numba_check():
        own = run_child("numba", "default")
        ours = run_child("numba", "gpupool", {"NUMBA_CUDA_MEMORY_MANAGER": "gpupool.numba"})
        ok = own["sha256"] == ours["sha256"] and ours["allocations"] > 0 and ours["manager"] == "GpupoolNumbaManager"
        report(ok, f"numba (NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba, manager {ours['manager']}): "
                   f"{'identical' if own['sha256'] == ours['sha256'] else 'DIFFERENT'} results; gpupool served "
                   f"{ours['allocations']} device allocations and {ours['host_allocations']} pinned segments"
                   f"{'' if ours['kernels'] else ' (kernels did not compile here: device copies only)'}")

    def together_check():
        r = run_child("together", "gpupool")
        ok = r["allocated_mib"] >= 14 and r["after_free_mib"] == 0 and r["reserved_after_empty_cache_mib"] == 0 \
            and r["sum"] == float(8 * MIB // 4 + 4 * MIB // 4 + 2 * MIB // 4)
        report(not r["stderr"], f"together exit (PyTorch, CuPy and Numba arrays alive): "
                                f"{'silent' if not r['stderr'] else 'NOT silent: ' + r['stderr'][-300:]}")
        report(ok, f"together (PyTorch 8 MiB, CuPy 4 MiB, Numba 2 MiB on one gpupool): {r['allocated_mib']:.2f} MiB "
                   f"allocated, {r['after_free_mib']:.2f} MiB after the frees, {r['reserved_after_empty_cache_mib']:.2f} "
                   f"MiB reserved after empty_cache")

    def ort_check():
        ours = run_child("onnxruntime", "gpupool")
        if "skipped" in ours:
            lines.append(f"onnxruntime: skipped: {ours['skipped']}")
            print(lines[-1])
            return
        own = run_child("onnxruntime", "default")
        report(own["sha256"] == ours["sha256"] and ours["allocations"] > 0,
               f"onnxruntime (CUDA execution provider, external allocator): "
               f"{'identical' if own['sha256'] == ours['sha256'] else 'DIFFERENT'} results; gpupool served "
               f"{ours['allocations']} allocations")

    for name, fn in (("cupy", cupy_check), ("numba", numba_check), ("together", together_check),
                     ("onnxruntime", ort_check)):
        attempt(name, fn)
    print(f"{passed} passed, {failed} failed")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plugins.txt"), "w") as f:
            f.write("\n".join(lines) + f"\n{passed} passed, {failed} failed\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
