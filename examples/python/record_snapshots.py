"""PyTorch's own memory snapshots, recorded for gpupool-replay's tests: files written by the real
tool the replay claims to read.

    python3 record_snapshots.py --out DIR [--steps 4]

Each snapshot is recorded in a process of its own (the allocator's configuration is fixed at a
process's first CUDA allocation), with torch.cuda.memory._record_memory_history and
_dump_snapshot, for every combination of:

- model: a transformer (a transformers BertModel of 2 layers, hidden 128, built from its config,
  nothing downloaded) run at random sequence lengths, and a CNN (torchvision's ResNet-18,
  training with SGD at batch 4/8 in turn);
- stacks: "python" and "all" (PyTorch's `stacks=` argument);
- expandable segments off and on (PYTORCH_CUDA_ALLOC_CONF);
- max_entries small enough that the ring wrapped (the trace starts after the run did).

Writes DIR/<model>-<stacks>-<exp|default>.pickle.gz and, beside each, a .json with
torch.cuda.max_memory_reserved() and max_memory_allocated() of the same run and the
configuration, which the replay's `recorded` row must match.
"""

import argparse
import gzip
import json
import os
import random
import subprocess
import sys


def run_model(model, steps):
    import torch

    random.seed(0)
    torch.manual_seed(0)
    if model == "transformer":
        from transformers import BertConfig, BertModel

        cfg = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256, vocab_size=1000)
        net = BertModel(cfg).cuda().eval()
        with torch.no_grad():
            for _ in range(steps * 3):
                length = random.randint(8, 96)
                ids = torch.randint(0, 1000, (random.randint(1, 4), length), device="cuda")
                net(ids)
    else:
        import torchvision

        net = torchvision.models.resnet18(num_classes=10).cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for i in range(steps):
            batch = (4, 8)[i % 2]
            x = torch.randn(batch, 3, 64, 64, device="cuda")
            y = torch.randint(0, 10, (batch,), device="cuda")
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.cuda.synchronize()


def child(args):
    import torch

    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks=args.stacks)
    run_model(args.model, args.steps)
    name = f"{args.model}-{args.stacks}-{'exp' if args.expandable else 'default'}"
    raw = os.path.join(args.out, name + ".pickle")
    torch.cuda.memory._dump_snapshot(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb", compresslevel=9) as g:
        g.write(f.read())
    os.remove(raw)
    meta = {
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "stacks": args.stacks,
        "max_entries": args.max_entries,
        "model": args.model,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(name, os.path.getsize(raw + ".gz"), "bytes gzipped;", meta["max_memory_reserved"], "reserved at peak")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-entries", type=int, default=1500)
    p.add_argument("--child", action="store_true")
    p.add_argument("--model")
    p.add_argument("--stacks")
    p.add_argument("--expandable", type=int, default=0)
    args = p.parse_args()
    if args.child:
        return child(args)
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for model in ("transformer", "cnn"):
        for stacks in ("python", "all"):
            for expandable in (0, 1):
                env = dict(os.environ)
                env["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{'True' if expandable else 'False'}"
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", args.out,
                       "--steps", str(args.steps), "--max-entries", str(args.max_entries),
                       "--model", model, "--stacks", stacks, "--expandable", str(expandable)]
                failed += subprocess.call(cmd, env=env) != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
