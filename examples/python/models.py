"""Two real models built from code (nothing downloaded), run deterministically on one allocator:

- vision: torchvision's ResNet-18 training with SGD for some steps, batch sizes rotating
  16/32/48 (the allocator sees shapes change), loss of every step recorded;
- decoder: a transformers Llama decoder generating greedily with a growing KV cache, the
  generated token ids recorded.

    python3 models.py --allocator gpupool --out gpupool.json     # gpupool via CUDAPluggableAllocator
    python3 models.py --allocator pytorch --out pytorch.json     # PyTorch's own allocator

Under the LD_PRELOAD shim use --allocator pytorch with PYTORCH_NO_CUDA_MEMORY_CACHING=1; the
figures then come from the shim's gpupool when it is there (--allocator preload).
Writes the outputs, the step times (ms) and each workload's peak reserved bytes as JSON.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpupool_torch  # noqa: E402


def settings():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class Memory:
    """Peak reserved bytes per workload, from gpupool or from PyTorch's allocator."""

    def __init__(self, source):
        self.source = source

    def reset(self):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if self.source == "pytorch":
            torch.cuda.reset_peak_memory_stats()
        elif self.source in ("gpupool", "preload"):
            gpupool_torch.reset_peak_stats()

    def peak_reserved(self):
        torch.cuda.synchronize()
        if self.source == "pytorch":
            return torch.cuda.max_memory_reserved()
        if self.source in ("gpupool", "preload"):
            return gpupool_torch.stats()["reserved_bytes.all.peak"]
        return None


def vision(steps, mem):
    import torchvision

    settings()
    mem.reset()
    dev = torch.device("cuda")
    model = torchvision.models.resnet18(num_classes=100).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(steps):
        batch = (16, 32, 48)[step % 3]
        x = torch.randn(batch, 3, 128, 128, generator=gen).to(dev)
        y = torch.randint(0, 100, (batch,), generator=gen).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item().hex())
    peak = mem.peak_reserved()
    del model, opt
    return {"losses": losses, "step_ms": times, "peak_reserved": peak}


def decoder(new_tokens, mem):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings()
    mem.reset()
    dev = torch.device("cuda")
    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(dev).eval()
    gen = torch.Generator().manual_seed(2)
    tokens, times = [], []
    with torch.no_grad():
        for batch in (2, 6, 12):
            ids = torch.randint(1, 8000, (batch, 32), generator=gen).to(dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / new_tokens)
            tokens.append(out.tolist())
    peak = mem.peak_reserved()
    del model
    return {"tokens": tokens, "ms_per_token": times, "peak_reserved": peak}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocator", choices=["gpupool", "pytorch", "preload"], required=True)
    ap.add_argument("--lib", help="libgpupool.so (default: gpupool_torch.find_library())")
    ap.add_argument("--steps", type=int, default=30, help="training steps of the vision model")
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per batch by the decoder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    if args.allocator == "gpupool":
        gpupool_torch.install(args.lib)
    elif args.allocator == "preload":
        gpupool_torch.attach()  # the shim's gpupool, found among the process's symbols
    no_caching = bool(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"))
    # PyTorch's allocator keeps no figures when it does not cache (every tensor is a cudaMalloc).
    mem = Memory("none" if args.allocator == "pytorch" and no_caching else args.allocator)
    result = {"allocator": args.allocator, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0),
              "no_caching": no_caching}
    result["vision"] = vision(args.steps, mem)
    result["decoder"] = decoder(args.tokens, mem)
    if args.allocator in ("gpupool", "preload"):
        print(gpupool_torch.summary())
    v, d = result["vision"], result["decoder"]
    print(f"models ({args.allocator}): vision median step {statistics.median(v['step_ms'][5:]):.2f} ms, "
          f"final loss {float.fromhex(v['losses'][-1]):.6f}; decoder {statistics.median(d['ms_per_token']):.3f} ms/token")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
