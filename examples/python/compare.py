"""Runs models.py under each allocator in its own process and compares them.

    python3 compare.py --lib LIBGPUPOOL [--preload LIBGPUPOOL_PRELOAD] [--rounds N] --out DIR

Pluggable allocator: PyTorch's own allocator against gpupool through CUDAPluggableAllocator.
LD_PRELOAD: PyTorch with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (a cudaMalloc/cudaFree per tensor),
without the shim and with it. Each pair runs `rounds` times, alternating which goes first;
times are the medians over rounds of each run's median step (ms), peaks are bytes.

The outputs (every training loss, every generated token) must be identical within each pair:
the exit status is 1 when they are not. Times and peaks are reported against the targets
(step time within 2% of PyTorch's allocator, peak reserved no higher), not asserted: a timing
is a benchmark's business, not a test's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(name, allocator, out_dir, env_extra, args):
    out = os.path.join(out_dir, f"{name}.json")
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, os.path.join(HERE, "models.py"), "--allocator", allocator, "--out", out,
           "--steps", str(args.steps), "--tokens", str(args.tokens)]
    if allocator == "gpupool":
        cmd += ["--lib", args.lib]
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.exit(f"compare: {name} failed (exit {r.returncode}); see {name}.log")
    with open(out) as f:
        return json.load(f)


def summary(results):
    """Median over rounds of the per-run medians."""
    vis = statistics.median(statistics.median(r["vision"]["step_ms"][5:]) for r in results)
    dec = statistics.median(statistics.median(r["decoder"]["ms_per_token"]) for r in results)
    return vis, dec, results[0]["vision"]["peak_reserved"], results[0]["decoder"]["peak_reserved"]


def same_outputs(a, b):
    return a["vision"]["losses"] == b["vision"]["losses"] and a["decoder"]["tokens"] == b["decoder"]["tokens"]


def mib(x):
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


def pair(title, names, configs, args):
    """Runs two configurations `rounds` times each, alternating the order; prints a table."""
    runs = {n: [] for n in names}
    for k in range(args.rounds):
        order = names if k % 2 == 0 else names[::-1]
        for n in order:
            allocator, env = configs[n]
            runs[n].append(run(f"{n}-{k}", allocator, args.out, env, args))
    ok = all(same_outputs(runs[names[0]][0], r) for n in names for r in runs[n])
    (a, b) = (summary(runs[names[0]]), summary(runs[names[1]]))
    lines = [f"### {title}", "",
             f"| | {names[0]} | {names[1]} | {names[1]} / {names[0]} |", "|---|---|---|---|"]
    lines.append(f"| ResNet-18 training step (median ms) | {a[0]:.2f} | {b[0]:.2f} | {b[0] / a[0]:.3f} |")
    lines.append(f"| Llama decode (median ms/token) | {a[1]:.3f} | {b[1]:.3f} | {b[1] / a[1]:.3f} |")
    for i, what in ((2, "ResNet-18 peak reserved"), (3, "Llama decode peak reserved")):
        ratio = f"{b[i] / a[i]:.3f}" if a[i] and b[i] else "-"
        lines.append(f"| {what} | {mib(a[i])} | {mib(b[i])} | {ratio} |")
    lines.append("")
    lines.append(f"Outputs ({args.steps} losses, {3 * args.tokens} tokens a batch x 3 batches, {args.rounds} rounds "
                 f"each): {'identical' if ok else 'DIFFERENT'}.")
    text = "\n".join(lines)
    print(text + "\n", flush=True)
    return ok, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True, help="libgpupool.so")
    ap.add_argument("--preload", help="libgpupool_preload.so: also compare under LD_PRELOAD")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    ok, text = pair("PyTorch's allocator against gpupool (CUDAPluggableAllocator)", ["pytorch", "gpupool"],
                    {"pytorch": ("pytorch", {}), "gpupool": ("gpupool", {})}, args)
    report = [text]
    if args.preload:
        nc = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        shim = dict(nc, LD_PRELOAD=args.preload, GPUPOOL_PRELOAD_STATS="1")
        ok2, text = pair("PYTORCH_NO_CUDA_MEMORY_CACHING=1 without and with the LD_PRELOAD shim", ["cudaMalloc", "shim"],
                         {"cudaMalloc": ("pytorch", nc), "shim": ("preload", shim)}, args)
        report.append(text)
        ok = ok and ok2
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write("\n\n".join(report) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
