"""The memory of one model under PyTorch's allocator and under gpupool, as PyTorch's own memory
viewer shows it.

    python3 dump_snapshot.py --out DIR [--lib libgpupool.so] [--steps 6] [--max-entries 100000]

Runs models.vision (torchvision's ResNet-18 training, batch sizes 16/32/48 in turn) in two
processes, one per allocator (a process's CUDA allocator is chosen before its first tensor):

- pytorch: torch.cuda.memory._record_memory_history(max_entries=...), the steps, then
  torch.cuda.memory._dump_snapshot(DIR/pytorch.pickle);
- gpupool: gpupool made PyTorch's allocator through CUDAPluggableAllocator
  (gpupool_torch.install), gpupool_record_history(1, max_entries, GPUPOOL_HISTORY_CONTEXT_ALL)
  (gpupool_torch.record_history), the same steps, then gpupool_dump_snapshot(DIR/gpupool.pickle).

Then it reads both files back with pickle and prints, for each, its segments, the bytes they
reserve and hold allocated, and its events by action; and checks that gpupool's file has every
key PyTorch's viewer reads (torch/utils/viz/MemoryViz.js and torch/cuda/_memory_viz.py) where
PyTorch's has it, listing the keys either file has that the other lacks. Render either with
PyTorch's viewer:

    python3 -m torch.cuda._memory_viz trace_plot DIR/gpupool.pickle -o gpupool-trace.html
    python3 -m torch.cuda._memory_viz segment_plot DIR/gpupool.pickle -o gpupool-segments.html

(scripts/gpu.sh, section snapshot, runs this and renders all four.)
"""

import argparse
import collections
import os
import pickle
import subprocess
import sys
import time

# The keys PyTorch's viewer reads: the trace plots (process_alloc_data, annotate_snapshot), the
# segment plot (MemoryView, simulate_memory) and _memory_viz.py's text reports.
VIEWER_KEYS = {
    "snapshot": {"segments", "device_traces"},
    "segment": {"device", "address", "total_size", "stream", "blocks", "frames", "allocated_size"},
    "block": {"size", "requested_size", "state", "frames"},
    "event": {"action", "size", "stream", "frames"},
    "frame": {"filename", "line", "name"},
}


def child(args):
    """Runs the model on one allocator with its history recorded, and dumps the snapshot."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import gpupool_torch
    import models

    path = os.path.join(args.out, f"{args.allocator}.pickle")
    if args.allocator == "gpupool":
        gpupool_torch.install(args.lib)
        gpupool_torch.record_history(True, context="all", max_entries=args.max_entries)
    else:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
    result = models.vision(args.steps, models.Memory(args.allocator))
    torch.cuda.synchronize()
    # The dump's time: the allocator's snapshot and its pickle, written to the file (what a user
    # waits for); the median of three dumps of the same history.
    times = []
    for _ in range(3):
        start = time.perf_counter()
        if args.allocator == "gpupool":
            gpupool_torch.dump_snapshot(path)
        else:
            torch.cuda.memory._dump_snapshot(path)
        times.append(time.perf_counter() - start)
    if args.allocator == "gpupool":
        gpupool_torch.record_history(False)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)
    print(f"{args.allocator}: {args.steps} steps, final loss {float.fromhex(result['losses'][-1]):.6f}, "
          f"peak reserved {result['peak_reserved'] / 2**20:.1f} MiB; snapshot in {path}, "
          f"{os.path.getsize(path)} bytes, dumped in {sorted(times)[1] * 1e3:.1f} ms (median of 3)")


def keys(snap):
    """The keys of each kind of record in a snapshot, unioned over its records."""
    out = collections.defaultdict(set)
    out["snapshot"] = set(snap)
    for seg in snap["segments"]:
        out["segment"] |= set(seg)
        for f in seg.get("frames", []):
            out["frame"] |= set(f)
        for b in seg["blocks"]:
            out["block"] |= set(b)
    for trace in snap["device_traces"]:
        for e in trace:
            out["event"] |= set(e)
            for f in e.get("frames", []):
                out["frame"] |= set(f)
    return out


def describe(name, snap):
    reserved = sum(s["total_size"] for s in snap["segments"])
    allocated = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    actions = collections.Counter(e["action"] for t in snap["device_traces"] for e in t)
    framed = sum(1 for t in snap["device_traces"] for e in t if e.get("frames"))
    print(f"{name}: {len(snap['segments'])} segments, {reserved / 2**20:.1f} MiB reserved, "
          f"{allocated / 2**20:.1f} MiB allocated; events {dict(sorted(actions.items()))}, "
          f"{framed} with a call stack")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for pytorch.pickle and gpupool.pickle")
    ap.add_argument("--lib", help="libgpupool.so (default: gpupool_torch.find_library())")
    ap.add_argument("--steps", type=int, default=6, help="training steps")
    ap.add_argument("--max-entries", type=int, default=100000, help="events kept per device")
    ap.add_argument("--allocator", choices=["pytorch", "gpupool"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.allocator:
        child(args)
        return
    snaps = {}
    for allocator in ("pytorch", "gpupool"):
        cmd = [sys.executable, os.path.abspath(__file__), "--allocator", allocator, "--out", args.out,
               "--steps", str(args.steps), "--max-entries", str(args.max_entries)]
        if args.lib:
            cmd += ["--lib", args.lib]
        subprocess.run(cmd, check=True)
        with open(os.path.join(args.out, f"{allocator}.pickle"), "rb") as f:
            snaps[allocator] = pickle.load(f)
        describe(allocator, snaps[allocator])
    ours, theirs = keys(snaps["gpupool"]), keys(snaps["pytorch"])
    missing = False
    for kind in VIEWER_KEYS:
        lacking = (theirs[kind] & VIEWER_KEYS[kind]) - ours[kind]
        if lacking:
            missing = True
            print(f"gpupool's {kind} records lack {sorted(lacking)}, which PyTorch's viewer reads")
        extra = theirs[kind] - ours[kind] - lacking
        if extra:
            print(f"PyTorch's {kind} records also have {sorted(extra)} (the viewer does not read them)")
        if ours[kind] - theirs[kind]:
            print(f"gpupool's {kind} records also have {sorted(ours[kind] - theirs[kind])}")
    if missing:
        sys.exit(1)
    print("gpupool's snapshot has every key PyTorch's viewer reads")


if __name__ == "__main__":
    main()
