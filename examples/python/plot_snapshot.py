"""Draws PyTorch memory snapshots (gpupool's `gpupool_dump_snapshot` or PyTorch's
`torch.cuda.memory._dump_snapshot`) as one PNG, a column per snapshot: memory over the trace
(allocated and reserved bytes, from `device_traces`) and the segments at the end (each
segment a row, its blocks coloured by state, from `segments`). PyTorch's own viewer
(`python3 -m torch.cuda._memory_viz trace_plot FILE -o FILE.html`) renders the same files as
interactive HTML; this is for a static image, e.g. the README's. Needs matplotlib.

    python3 examples/python/plot_snapshot.py out.png gpupool.pickle:gpupool pytorch.pickle:PyTorch
"""
import pickle
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1 << 20
COLOURS = {"active_allocated": "#d62728", "active_pending_free": "#ff7f0e", "inactive": "#c7c7c7"}


def timeline(trace):
    """(event index, allocated MiB, reserved MiB) after each event of one device's trace."""
    allocated = reserved = 0
    xs, alloc, res = [], [], []
    for i, e in enumerate(trace):
        a, size = e["action"], e["size"]
        if a == "alloc":
            allocated += size
        elif a == "free_completed":
            allocated -= size
        elif a in ("segment_alloc", "segment_map"):
            reserved += size
        elif a in ("segment_free", "segment_unmap"):
            reserved -= size
        xs.append(i)
        alloc.append(allocated / MIB)
        res.append(reserved / MIB)
    return xs, alloc, res


def main():
    out, specs = sys.argv[1], sys.argv[2:]
    fig, axes = plt.subplots(2, len(specs), figsize=(6.5 * len(specs), 7), squeeze=False)
    for col, spec in enumerate(specs):
        path, _, label = spec.partition(":")
        with open(path, "rb") as f:
            snap = pickle.load(f)
        trace = next((t for t in snap["device_traces"] if t), [])
        xs, alloc, res = timeline(trace)
        ax = axes[0][col]
        ax.plot(xs, res, label="reserved (segments)", color="#1f77b4")
        ax.plot(xs, alloc, label="allocated (blocks)", color="#d62728")
        ax.set_title(f"{label or path}: memory over the trace")
        ax.set_xlabel("event")
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left")
        ax = axes[1][col]
        segs = sorted(snap["segments"], key=lambda s: s["address"])
        for row, s in enumerate(segs):
            at = 0
            for b in s["blocks"]:
                ax.barh(row, b["size"] / MIB, left=at / MIB, color=COLOURS.get(b["state"], "#000000"), height=0.8)
                at += b["size"]
        ax.set_title(f"{label or path}: segments at the end ({len(segs)}), blocks by state")
        ax.set_xlabel("MiB from the segment's start")
        ax.set_ylabel("segment")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
        ax.legend(handles, list(COLOURS), loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
