"""CuPy's own MemoryPool against gpupool under CuPy on a mixed workload (issue 41; scripts/gpu.sh's
`cupy` section).

    python3 examples/python/cupy_mixed.py [--reps 5] [--steps 300] [--out DIR]

The workload: matrix products, FFTs, sorts and reductions over shapes that change step to step,
on three CuPy streams of its own (step i on stream i % 3), `--steps` steps, every array freed
when its step ends. Each run is a fresh process on one allocator:

- cupy            CuPy's MemoryPool (CuPy's default)
- gpupool         gpupool.cupy.install(): the compiled hook (gpupool_cupy_hook_malloc under
                  CFunctionAllocator, CuPy's current stream read by CuPy's C getter)
- gpupool-python  gpupool.cupy.install(compiled=False): PythonFunctionAllocator, Python on
                  every allocation and free (the route issue 41 measured at 1.36x CuPy's time)

The runs alternate (cupy, gpupool, gpupool-python, then the reverse order, ...) `--reps` times
after one unmeasured run that fills CuPy's kernel cache. Each run times two passes of the
workload: the first from an empty pool (it includes the pool's growth), the second on the
cache the first left. Printed: the median seconds of each pass per allocator and gpupool's
ratio to CuPy's (below 1: faster), the median ns of a cupy.empty and its free (4 KiB and 1
MiB, the allocator alone), the peak reserved bytes (CuPy: MemoryPool.total_bytes()
after each step, its maximum; gpupool: reserved_bytes.all.peak), that every run's results
are bit for bit the same (a SHA-256 of every step's results), and whether each run's exit was
silent (nothing on stderr, status 0) with arrays, including cuFFT plans' work areas, alive at
exit. Exits 1 when results differ, the gpupool route is not the hook, or gpupool's exit was
not silent. Writes cupy_mixed.json and cupy_mixed.txt into --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ALLOCATORS = ("cupy", "gpupool", "gpupool-python")


def workload(cp, streams, steps, sample):
    """`steps` steps of mixed work on `streams`; returns the SHA-256 of every step's results.
    `sample()` is called after each step (the peak reserved of CuPy's pool)."""
    import hashlib

    sums = []
    # One generator a stream, made afresh each pass: the same inputs in every pass and run.
    rngs = [cp.random.RandomState(1000 + i) for i in range(len(streams))]
    for step in range(steps):
        stream = streams[step % len(streams)]
        with stream:
            rng = rngs[step % len(streams)]
            n = 128 + 64 * ((step * 7) % 13)  # 128 to 896: blocks of changing sizes
            m = 1 << (10 + (step % 6))  # FFT and sort lengths, 1 Ki to 32 Ki
            a = rng.standard_normal((n, n), dtype=cp.float32)
            b = rng.standard_normal((n, n), dtype=cp.float32)
            c = a @ b
            d = cp.tanh(c[: n // 2]) @ b[:, : n // 3]
            x = rng.standard_normal((16, m), dtype=cp.float32)
            spectrum = cp.fft.rfft(x, axis=1)
            power = cp.abs(spectrum) ** 2
            back = cp.fft.irfft(spectrum, n=m, axis=1)
            keys = rng.standard_normal(m * 4, dtype=cp.float32)
            ordered = cp.sort(keys)
            order = cp.argsort(keys[: m])
            parts = cp.stack([
                c.sum(dtype=cp.float64), d.max().astype(cp.float64), power.mean(axis=1).sum(dtype=cp.float64),
                cp.abs(back - x).max().astype(cp.float64), ordered[:: max(1, m // 7)].sum(dtype=cp.float64),
                order[:8].astype(cp.float64).sum(), c.std(axis=0).sum(dtype=cp.float64),
            ])
            sums.append(parts)
            del a, b, c, d, x, spectrum, power, back, keys, ordered, order
        sample()
    for s in streams:
        s.synchronize()
    h = hashlib.sha256()
    for parts in sums:
        h.update(cp.asnumpy(parts).tobytes())
    return h.hexdigest()


def child(allocator, steps):
    import cupy as cp

    result = {"allocator": allocator}
    if allocator.startswith("gpupool"):
        import gpupool

        gpupool.cupy.install(compiled=(allocator == "gpupool"))
        result["route"] = gpupool.cupy.route()
    pool = cp.get_default_memory_pool()
    peak = [0]

    def sample():
        if allocator == "cupy":
            peak[0] = max(peak[0], pool.total_bytes())

    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    times, digests = [], []
    for _ in range(2):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        digests.append(workload(cp, streams, steps, sample))
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    result["seconds"] = times
    # The allocator alone: cupy.empty and its free, no kernel, on one of the streams.
    with streams[1]:
        for size in (4096, 1 << 20):
            for _ in range(1000):
                cp.empty(size, dtype=cp.uint8)
            start = time.perf_counter()
            for _ in range(20000):
                cp.empty(size, dtype=cp.uint8)
            result[f"empty_ns_{size}"] = (time.perf_counter() - start) / 20000 * 1e9
    result["sha256"] = digests[0]
    result["passes_agree"] = digests[0] == digests[1]
    if allocator == "cupy":
        result["peak_reserved"] = peak[0]
    else:
        s = gpupool.stats(0)
        result["peak_reserved"] = s["reserved_bytes.all.peak"]
        result["allocations"] = s["allocation.all.allocated"]
    # Kept alive to the exit, where the teardown frees them: arrays in a module's globals and in
    # a reference cycle, besides CuPy's cuFFT plan cache.
    cp._cupy_mixed_kept = [cp.ones(1000 + i, dtype=cp.float32) for i in range(8)]
    cycle = {"arrays": [cp.zeros(4096 * (i + 1), dtype=cp.uint8) for i in range(8)]}
    cycle["self"] = cycle
    print(json.dumps(result), flush=True)


def run(allocator, steps):
    p = subprocess.run([sys.executable, __file__, "--child", allocator, "--steps", str(steps)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or not p.stdout.strip():
        raise RuntimeError(f"{allocator}: exit {p.returncode}\n{p.stdout}{p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["stderr_lines"] = len(p.stderr.splitlines())
    r["stderr_tail"] = p.stderr[-600:]
    return r


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=ALLOCATORS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps)
        return 0
    run("cupy", min(args.steps, 30))  # CuPy's kernel cache filled, not measured
    runs = {a: [] for a in ALLOCATORS}
    for rep in range(args.reps):
        order = ALLOCATORS if rep % 2 == 0 else tuple(reversed(ALLOCATORS))
        for a in order:
            runs[a].append(run(a, args.steps))
    lines = [f"CuPy mixed workload, 3 streams, {args.steps} steps, {args.reps} runs each, "
             f"alternating ({time.strftime('%Y-%m-%d')})"]
    med = {a: [statistics.median(r["seconds"][i] for r in runs[a]) for i in (0, 1)] for a in ALLOCATORS}
    for a in ALLOCATORS:
        peak = max(r["peak_reserved"] for r in runs[a]) / 1e6
        lines.append(f"  {a:15s} first pass {med[a][0]:.3f} s ({med[a][0] / med['cupy'][0]:.2f}x CuPy's), "
                     f"second pass {med[a][1]:.3f} s ({med[a][1] / med['cupy'][1]:.2f}x), peak reserved "
                     f"{peak:,.0f} MB, exit stderr lines {sorted({r['stderr_lines'] for r in runs[a]})}")
    for a in ALLOCATORS:
        ns = [statistics.median(r[f"empty_ns_{size}"] for r in runs[a]) for size in (4096, 1 << 20)]
        lines.append(f"  {a:15s} cupy.empty + free: {ns[0]:,.0f} ns (4 KiB), {ns[1]:,.0f} ns (1 MiB)")
    digests = {r["sha256"] for a in ALLOCATORS for r in runs[a]}
    same = len(digests) == 1 and all(r["passes_agree"] for a in ALLOCATORS for r in runs[a])
    routes = {r.get("route") for r in runs["gpupool"]}
    silent = all(r["stderr_lines"] == 0 for a in ("cupy", "gpupool") for r in runs[a])
    lines.append(f"  results: {'identical' if same else 'DIFFERENT'} across every run ({sorted(digests)[0][:16]})")
    lines.append(f"  gpupool route: {sorted(routes, key=str)} (hook expected); exit silent under CuPy's pool "
                 f"and the hook: {'yes' if silent else 'NO'}")
    if not silent:
        tails = [r["stderr_tail"] for a in ("cupy", "gpupool") for r in runs[a] if r["stderr_lines"]]
        lines.append("  first exit stderr: " + tails[0].replace("\n", "\n    "))
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cupy_mixed.json"), "w") as f:
            json.dump(runs, f, indent=1)
        with open(os.path.join(args.out, "cupy_mixed.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if same and routes == {"hook"} and silent else 1


if __name__ == "__main__":
    sys.exit(main())
