"""Annotated snapshots on the GPU (issue 43), under PyTorch with gpupool as its pluggable
allocator: metadata set per phase (gpupool.set_memory_metadata, PyTorch's
_set_memory_metadata), a tensor annotated through a view (gpupool.torch.annotate_tensor,
PyTorch's _annotate_tensor), 100,000 events of history, then the snapshot dumped with and
without its traces (the median of 5 dumps each, file written) and read by PyTorch's own
torch.cuda._memory_viz: its text trace must print the annotation, and the alloc of the
annotated tensor must carry its phase's metadata. Prints the figures; exits 1 on a failed
check. scripts/gpu.sh runs it in its snapshot section:

    python3 examples/python/annotated_snapshot.py --lib PREFIX/lib/libgpupool.so --out DIR
"""

import argparse
import os
import pickle
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--events", type=int, default=100_000)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch
    from torch.cuda import _memory_viz

    import gpupool
    import gpupool.torch as gt

    gt.install(args.lib)
    gpupool.record_history(True, "all", args.events + 1000)
    gpupool.set_memory_metadata({"phase": "load"})
    weights = torch.randn(1024, 1024, device="cuda")
    gpupool.set_memory_metadata({"phase": "step"})
    # An alloc, a free_requested and a free_completed each: the history's events, and more.
    for _ in range(args.events // 3):
        x = torch.empty(4096, device="cuda")
        del x
    gt.annotate_tensor(weights[10:], "weights, annotated through a view")
    gpupool.set_memory_metadata("")
    torch.cuda.synchronize()

    times = {}
    for traces in (True, False):
        path = os.path.join(args.out, "annotated.pickle" if traces else "annotated-lite.pickle")
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            gpupool.dump_snapshot(path, include_traces=traces)
            runs.append(time.perf_counter() - start)
        times[traces] = (statistics.median(runs), os.path.getsize(path), path)
    for traces, (t, size, path) in times.items():
        print(f"dump {'with' if traces else 'without'} traces: {t * 1e3:.3f} ms, {size} bytes ({path})")

    ok = True
    with open(times[True][2], "rb") as f:
        data = pickle.load(f)
    text = _memory_viz.trace(data)
    # PyTorch's text trace names annotations from the release that added them (PR #190575,
    # in 2.15); an older one prints the event as a dict.
    import inspect

    if '"annotate"' in inspect.getsource(_memory_viz.trace):
        shown = re.search(r"^# annotate \w+: weights, annotated through a view$", text, re.M)
    else:
        print(f"(torch {torch.__version__}'s _memory_viz predates annotate events: looking for the dict)")
        shown = re.search(r"'action': 'annotate'.*'user_metadata': 'weights, annotated through a view'", text)
    if not shown:
        print("FAILED: PyTorch's _memory_viz.trace shows no annotation")
        ok = False
    base = weights.untyped_storage().data_ptr()
    allocs = [e for e in data["device_traces"][weights.device.index] if e["action"] == "alloc" and e["addr"] == base]
    if not allocs or allocs[-1].get("user_metadata") != '{"phase":"load"}':
        print(f"FAILED: the weights' alloc carries {allocs[-1].get('user_metadata') if allocs else None!r}")
        ok = False
    with open(times[False][2], "rb") as f:
        lite = pickle.load(f)
    if any(lite["device_traces"]) or len(lite["segments"]) != len(data["segments"]):
        print("FAILED: the snapshot without traces has events, or other segments")
        ok = False
    print("annotated snapshot: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
