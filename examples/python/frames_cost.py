"""What a stack with Python frames costs per allocation, gpupool against PyTorch, and whether
PyTorch's viewer shows the Python frames of gpupool's snapshot.

    python3 frames_cost.py --sim  [--lib libgpupool.so] [--n 20000] [--depth 10]
    python3 frames_cost.py --torch [--lib libgpupool.so] [--n 20000] [--depth 10] [--out DIR]

--sim (no GPU, no PyTorch; GPUPOOL_DRIVER=sim): gpupool_malloc + gpupool_free through ctypes,
called DEPTH Python frames deep, with history off, then on (context all) with native frames
only, native and Python frames ("all"), Python frames only; ns per malloc+free pair, the
fastest of 5 runs.

--torch (a GPU): the same loop of `x = torch.empty(1 MiB); del x`, DEPTH frames deep, in one
process per allocator (a process's allocator is chosen before its first tensor): PyTorch's own
with `_record_memory_history(context="all", stacks=...)`, and gpupool through
CUDAPluggableAllocator (gpupool_torch.install) with gpupool_torch.record_history(stacks=...);
ns per torch.empty+free, history off and on. Then, on gpupool, a small MLP trains 3 steps with
history on, its snapshot goes to DIR/frames.pickle, and PyTorch's viewer code
(torch.cuda._memory_viz: memory()'s folded stacks, trace_plot) must show this file's frames.
Exits 1 when a check fails. (scripts/gpu.sh, section frames, runs it.)"""

import argparse
import ctypes
import os
import pickle
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpupool_torch  # noqa: E402


def at_depth(depth, f):
    """f() called `depth` Python frames deep."""
    return f() if depth <= 1 else at_depth(depth - 1, f)


def best_ns(loop, n, runs=5):
    """The fastest of `runs` timings of loop(n), in ns per iteration."""
    best = None
    for _ in range(runs):
        t = time.perf_counter_ns()
        loop(n)
        dt = (time.perf_counter_ns() - t) / n
        best = dt if best is None else min(best, dt)
    return best


def sim(args):
    lib = ctypes.CDLL(args.lib or gpupool_torch.find_library())
    lib.gpupool_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpupool_free.argtypes = [ctypes.c_void_p]
    lib.gpupool_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_uint32]
    p = ctypes.c_void_p()
    ref = ctypes.byref(p)

    def loop(n):
        for _ in range(n):
            lib.gpupool_malloc(ref, 4096, 0, None)
            lib.gpupool_free(p)

    rows = [("off", None), ("on, native frames", 3 | 0x20), ("on, native + Python frames (all)", 3),
            ("on, Python frames only", 3 | 0x10)]
    print(f"gpupool through ctypes, {args.n} malloc+free pairs {args.depth} Python frames deep, fastest of 5")
    base = None
    for name, context in rows:
        lib.gpupool_record_history(0 if context is None else 1, 100000, context or 0)
        ns = at_depth(args.depth, lambda: best_ns(loop, args.n))
        base = ns if base is None else base
        print(f"  history {name:34} {ns:9.0f} ns a pair  (+{ns - base:.0f})")
    lib.gpupool_record_history(0, 0, 0)
    return 0


def torch_run(args):
    """One allocator in this process: prints 'RESULT <allocator> <history> <ns>' lines."""
    import torch

    who = args.run
    if who == "gpupool":
        gpupool_torch.install(args.lib)

    def record(stacks):
        if who == "gpupool":
            if stacks is None:
                gpupool_torch.record_history(False)
            else:
                gpupool_torch.record_history(True, "all", 100000, stacks=stacks)
        elif stacks is None:
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            torch.cuda.memory._record_memory_history(max_entries=100000, context="all", stacks=stacks)

    def loop(n):
        for _ in range(n):
            x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            del x

    loop(100)
    torch.cuda.synchronize()
    for stacks in [None, "python", "all"]:
        record(stacks)
        ns = at_depth(args.depth, lambda: best_ns(loop, args.n))
        print(f"RESULT {who} {stacks or 'off'} {ns:.0f}", flush=True)
    record(None)
    if who != "gpupool":
        return 0
    return viewer_check(args, torch)


def train_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def viewer_check(args, torch):
    """A small model's snapshot through gpupool, read by PyTorch's viewer code."""
    from torch.cuda import _memory_viz

    gpupool_torch.record_history(True, "all", 100000, stacks="all")
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 512, device="cuda")
    for _ in range(3):
        train_step(model, opt, x)
    torch.cuda.synchronize()
    path = os.path.join(args.out, "frames.pickle")
    gpupool_torch.dump_snapshot(path)
    gpupool_torch.record_history(False)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    me = os.path.basename(__file__)
    events = [e for t in snap["device_traces"] for e in t if e["action"] == "alloc"]
    with_py = [e for e in events if any(fr["filename"].endswith(".py") for fr in e["frames"])]
    ours = [e for e in events if any(fr["filename"].endswith(me) and fr["name"] == "train_step" for fr in e["frames"])]
    print(f"snapshot {path}: {len(events)} alloc events, {len(with_py)} with Python frames, "
          f"{len(ours)} naming {me}'s train_step")
    example = next((e for e in ours), None)
    if example:
        print("  an allocation's Python frames, innermost first:")
        for fr in [fr for fr in example["frames"] if fr["filename"].endswith(".py")][:8]:
            print(f"    {fr['filename']}:{fr['line']} {fr['name']}")
    folded = _memory_viz.memory(snap, format_flamegraph=lambda s: s)
    in_viewer = me in folded
    print(f"_memory_viz.memory() folded stacks name {me}: {in_viewer}")
    html = _memory_viz.trace_plot(snap)
    with open(os.path.join(args.out, "frames-trace.html"), "w") as f:
        f.write(html)
    print(f"_memory_viz.trace_plot(): {len(html)} bytes of HTML (frames-trace.html)")
    ok = bool(ours) and in_viewer and len(html) > 0
    print("viewer check: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def torch_compare(args):
    results, status = {}, 0
    for who in ["pytorch", "gpupool"]:
        cmd = [sys.executable, __file__, "--run", who, "--n", str(args.n), "--depth", str(args.depth),
               "--out", args.out] + (["--lib", args.lib] if args.lib else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write("".join(l + "\n" for l in r.stdout.splitlines() if not l.startswith("RESULT")))
        sys.stderr.write(r.stderr)
        status |= r.returncode != 0
        for line in r.stdout.splitlines():
            if line.startswith("RESULT"):
                _, w, h, ns = line.split()
                results[(w, h)] = float(ns)
    print(f"\nns per torch.empty(1 MiB)+free, {args.n} calls {args.depth} Python frames deep, fastest of 5")
    print(f"{'history':10} {'PyTorch':>10} {'gpupool':>10}")
    for h in ["off", "python", "all"]:
        row = [results.get((w, h)) for w in ["pytorch", "gpupool"]]
        print(f"{h:10} " + " ".join(f"{v:10.0f}" if v is not None else f"{'-':>10}" for v in row))
    return 1 if status or len(results) != 6 else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--run", choices=["pytorch", "gpupool"], help=argparse.SUPPRESS)
    ap.add_argument("--lib")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--depth", type=int, default=10)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.run:
        return torch_run(args)
    if args.torch:
        return torch_compare(args)
    return sim(args)


if __name__ == "__main__":
    sys.exit(main())
