"""torch.cuda.graph on gpupool: a small model captured into CUDA graphs and replayed, its
outputs compared bit for bit with the same program on PyTorch's own allocator.

    python3 graphs.py --lib LIBGPUPOOL --out DIR

Each allocator runs in its own process (PyTorch picks its allocator once per process). The
program: an MLP, warmed up on a side stream, captured at two batch sizes into two graphs that
share one private pool (torch.cuda.graph's pool= argument), replayed on 20 inputs each; every
replay's output is kept and saved. On gpupool it also checks the pool's life: the pool holds
memory while the graphs live, gives it back when they are reset (PyTorch's releasePool), and a
capture that fails on purpose (a synchronisation inside it) leaves nothing behind when captured
through gpupool_torch.graph. Exit status 1 when the outputs differ or a check fails.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def model_outputs(torch):
    """The outputs of every replay, and the graphs' private pool id."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048), torch.nn.GELU(),
        torch.nn.Linear(2048, 256)).cuda().eval()
    big = torch.zeros(64, 512, device="cuda")
    small = torch.zeros(8, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(big)
            model(small)
    torch.cuda.current_stream().wait_stream(side)
    g_big, g_small = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(g_big):
            out_big = model(big)
        with torch.cuda.graph(g_small, pool=g_big.pool()):
            out_small = model(small)
    gen = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(20):
        for static_in, g, static_out in ((big, g_big, out_big), (small, g_small, out_small)):
            static_in.copy_(torch.randn(static_in.shape, generator=gen))
            g.replay()
            outs.append(static_out.clone().cpu())
    torch.cuda.synchronize()
    return outs, (g_big, g_small, out_big, out_small, model, big, small)


def live_blocks(gpupool_torch, path):
    """The allocated blocks of gpupool's snapshot (written to `path`), by address: (segment,
    block)."""
    import pickle

    gpupool_torch.dump_snapshot(path)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    return {b["address"]: (seg, b) for seg in snap["segments"] for b in seg["blocks"]
            if b["state"] == "active_allocated"}


def child(args):
    import torch

    if args.allocator == "gpupool":
        sys.path.insert(0, HERE)
        import gpupool_torch

        gpupool_torch.install(args.lib)
        if gpupool_torch._graphs is None:
            sys.exit("graphs: libgpupool_torch_graphs.so is not beside " + args.lib)
        # With the history on, a check that fails says which blocks are left, and from where.
        gpupool_torch.record_history(context="alloc", max_entries=100000)
    outs, keep = model_outputs(torch)
    torch.save(outs, args.save)
    if args.allocator != "gpupool":
        return 0
    ok = True
    g_big, g_small = keep[0], keep[1]
    pool = g_big.pool()
    held = gpupool_torch.pool_stats(pool)
    print(f"graphs: private pool {pool}: {held['reserved_bytes.all.current']} bytes reserved, "
          f"{held['allocated_bytes.all.current']} allocated while the graphs live")
    ok &= held["reserved_bytes.all.current"] > 0
    # The graphs go (reset calls releasePool), then their static outputs: the pool's memory
    # goes back to the driver.
    g_big.reset()
    g_small.reset()
    del keep, g_big, g_small
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gone = gpupool_torch.pool_stats(pool)
    print(f"graphs: after reset: pool {'released' if gone is None else gone}")
    ok &= gone is None
    # A capture that fails: a synchronisation inside it invalidates it. PyTorch itself keeps
    # two blocks of its own for it outside the capture's pool, for good: the RNG's seed and
    # offset tensors, which CUDAGraph::capture_begin allocates when no graph is registered with
    # the generator (CUDAGeneratorState::register_graph) and which a failed graph never
    # unregisters. A graph kept alive across the check holds that registration, so that what
    # the check sees is the failed capture's pool alone.
    holder, holder_in = torch.cuda.CUDAGraph(), torch.zeros(8, device="cuda")
    with torch.cuda.graph(holder):
        holder_in.add_(1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = gpupool_torch.stats()["reserved_bytes.all.current"]
    free_before = torch.cuda.mem_get_info()[0]
    live_before = live_blocks(gpupool_torch, os.path.join(args.out, "graphs_before.pickle"))
    x = torch.zeros(64, 512, device="cuda")
    torch.cuda.synchronize()
    failed = torch.cuda.CUDAGraph()
    try:
        with gpupool_torch.graph(failed):
            y = x @ x.T  # noqa: F841 (allocated in the pool)
            torch.cuda.synchronize()
        print("graphs: the capture that should fail did not")
        ok = False
    except RuntimeError as e:
        print(f"graphs: a failed capture raised: {str(e).splitlines()[0][:120]}; "
              f"{gpupool_torch.released_by_failed_capture} pool released")
        ok &= gpupool_torch.released_by_failed_capture == 1
    del x
    y = None  # noqa: F841
    del failed
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = gpupool_torch.stats()["reserved_bytes.all.current"]
    free_after = torch.cuda.mem_get_info()[0]
    del holder, holder_in
    print(f"graphs: after the failed capture: gpupool reserved {after} bytes (before {before}), "
          f"device free {free_after} bytes (before {free_before})")
    if after != before or free_after != free_before:
        print(gpupool_torch.summary())
        live_after = live_blocks(gpupool_torch, os.path.join(args.out, "graphs_after.pickle"))
        for addr, (seg, b) in sorted(live_after.items()):
            if addr in live_before:
                continue
            names = [f.get("name", "?") for f in b.get("frames", [])][:14]
            print(f"graphs: live since the failed capture: {b['size']} bytes at {addr:#x}, segment {seg['address']:#x} "
                  f"({seg['segment_type']}, pool {seg['segment_pool_id']}, stream {seg['stream']:#x}): {names}")
        ok = False
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--allocator", choices=["native", "gpupool"])
    p.add_argument("--save")
    args = p.parse_args()
    if args.allocator:
        return child(args)
    os.makedirs(args.out, exist_ok=True)
    saved = {}
    for allocator in ("native", "gpupool"):
        saved[allocator] = os.path.join(args.out, f"graphs_{allocator}.pt")
        r = subprocess.run([sys.executable, __file__, "--lib", args.lib, "--out", args.out, "--allocator", allocator,
                            "--save", saved[allocator]])
        if r.returncode != 0:
            print(f"graphs: the {allocator} run failed (exit {r.returncode})")
            return 1
    import torch

    a, b = torch.load(saved["native"]), torch.load(saved["gpupool"])
    same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    print(f"graphs: {len(b)} replays, outputs {'identical' if same else 'DIFFERENT'} on gpupool and on "
          "PyTorch's allocator")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
