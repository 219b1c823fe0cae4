"""Records allocation traces of real models with dynamic shapes, in the format of shared/traces,
and measures PyTorch's own allocator on the same runs. Nothing is downloaded: every model is
built from its configuration with random weights.

    python3 record_trace.py --out DIR [--workloads bert_infer,gpt2_generate,bert_train] [--quick]

The workloads (seeded: every run of one workload makes the same requests):

- bert_infer: transformers BertModel(BertConfig()) (base: 12 layers, hidden 768), fp16, eval,
  under torch.no_grad, 300 forward passes at random sequence lengths (uniform 16..512) and batch
  sizes (uniform 1..32), the pooled output copied to the host after each;
- gpt2_generate: GPT2LMHeadModel(GPT2Config()) (124M), fp16, greedy generation with the KV
  cache, 16 prompts of random length (16..256) and batch size (1..16), each generating a random
  number of tokens (16..48);
- bert_train: BertForMaskedLM(BertConfig()), AdamW, bf16 autocast, 60 training steps at random
  sequence lengths (32..512) and batch sizes (1..16), 15% of the tokens masked;
- t5_generate: T5ForConditionalGeneration(T5Config()) (an encoder-decoder, 6+6 layers, d_model
  512), bf16, eval: 24 batches of random input length (16..512) and batch size (1..16), each
  decoding a random number of tokens (8..64) greedily with the KV cache;
- resnet_train: transformers ResNetForImageClassification(ResNetConfig()) (ResNet-50's shape),
  SGD with momentum, bf16 autocast, channels-last, 40 training steps at random image sizes
  (96..320, multiples of 32) and batch sizes (4..32).

--quick runs a tenth of the passes, to check the script.

For each workload, three child processes run the same code:
1. under trace_alloc.c installed with torch.cuda.memory.CUDAPluggableAllocator (built here at
   run time with gcc against libcudart), which writes every request to DIR/NAME.txt, then
   gzipped to DIR/NAME.txt.gz;
2. under PyTorch's caching allocator, default configuration;
3. the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
(2) and (3) report torch.cuda.max_memory_reserved() and PyTorch's peak of requested bytes
(memory_stats "requested_bytes.all.peak"), which equals the trace's live peak when the runs made
the same requests. Prints a table like shared/traces/README.md's, also written to
DIR/traces.md. Exit status 1 when a child fails.
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ["bert_infer", "gpt2_generate", "bert_train", "t5_generate", "resnet_train"]
DESCRIPTION = {
    "bert_infer": "BERT-base encoder (BertModel), fp16, eval, no_grad; {n} forward passes, "
                  "sequence length 16..512, batch 1..32, uniform",
    "gpt2_generate": "GPT-2 (124M) fp16, greedy generation with KV cache; {n} prompts, length 16..256, "
                     "batch 1..16, 16..48 new tokens",
    "bert_train": "BERT-base masked LM training, AdamW, bf16 autocast; {n} steps, sequence length "
                  "32..512, batch 1..16",
    "t5_generate": "T5 (t5-small's shape) bf16, greedy generation with KV cache; {n} batches, input length "
                   "16..512, batch 1..16, 8..64 new tokens",
    "resnet_train": "ResNet-50 (transformers ResNetConfig) training, SGD, bf16 autocast, channels-last; {n} "
                    "steps, image side 96..320, batch 4..32",
}
PASSES = {"bert_infer": 300, "gpt2_generate": 16, "bert_train": 60, "t5_generate": 24, "resnet_train": 40}


# ---------------------------------------------------------------------------------------------
# The workloads (run in a child process)

# What each pass copied to the host, hashed (so that runs under different allocators can be
# compared bit for bit), and when each pass ended (each ends with that copy, which waits for
# the GPU): dynamic_compare.py reads both.
_DIGEST = hashlib.sha256()
_PASS_ENDS = []


def seen(tensor):
    """Records a pass's output (already on the host) and the time the pass ended."""
    _DIGEST.update(tensor.contiguous().numpy().tobytes())
    _PASS_ENDS.append(time.perf_counter())


def settings():
    import torch
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False


def bert_infer(passes):
    import torch
    from transformers import BertConfig, BertModel

    settings()
    dev = torch.device("cuda")
    config = BertConfig()
    model = BertModel(config).to(dev, dtype=torch.float16).eval()
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(passes):
            batch, length = rng.randint(1, 32), rng.randint(16, 512)
            ids = torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(dev)
            mask = torch.ones_like(ids)
            out = model(input_ids=ids, attention_mask=mask)
            seen(out.pooler_output.float().cpu())
    return {"attn_implementation": getattr(model.config, "_attn_implementation", None)}


def gpt2_generate(passes):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    settings()
    dev = torch.device("cuda")
    config = GPT2Config()
    model = GPT2LMHeadModel(config).to(dev, dtype=torch.float16).eval()
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(passes):
            batch, length, new = rng.randint(1, 16), rng.randint(16, 256), rng.randint(16, 48)
            ids = torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(dev)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, use_cache=True, pad_token_id=config.eos_token_id)
            seen(out.cpu())
    return {"attn_implementation": getattr(model.config, "_attn_implementation", None)}


def bert_train(passes):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    settings()
    dev = torch.device("cuda")
    config = BertConfig()
    model = BertForMaskedLM(config).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(passes):
        batch, length = rng.randint(1, 16), rng.randint(32, 512)
        ids = torch.randint(0, config.vocab_size, (batch, length), generator=gen)
        labels = torch.where(torch.rand(batch, length, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
        ids, labels = ids.to(dev), labels.to(dev)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        loss.backward()
        opt.step()
        seen(loss.detach().float().cpu())
    return {"attn_implementation": getattr(model.config, "_attn_implementation", None)}


def t5_generate(passes):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    settings()
    dev = torch.device("cuda")
    # T5Config() leaves the decoder's first token unset (the checkpoints set it): pad, as t5-small.
    config = T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(config).to(dev, dtype=torch.bfloat16).eval()
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(passes):
            batch, length, new = rng.randint(1, 16), rng.randint(16, 512), rng.randint(8, 64)
            ids = torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(dev)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, use_cache=True)
            seen(out.cpu())
    return {"attn_implementation": getattr(model.config, "_attn_implementation", None)}


def resnet_train(passes):
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    settings()
    dev = torch.device("cuda")
    model = ResNetForImageClassification(ResNetConfig()).to(dev, memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(passes):
        batch, side = rng.randint(4, 32), 32 * rng.randint(3, 10)
        x = torch.randn(batch, 3, side, side, generator=gen).to(dev, memory_format=torch.channels_last)
        labels = torch.randint(0, model.config.num_labels, (batch,), generator=gen).to(dev)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(pixel_values=x, labels=labels).loss
        loss.backward()
        opt.step()
        seen(loss.detach().float().cpu())
    return {}


def child(args):
    import ctypes

    if args.mode == "record":
        import torch

        lib = ctypes.CDLL(args.lib)
        lib.trace_open.argtypes = [ctypes.c_char_p]
        lib.trace_close.restype = ctypes.c_longlong
        if lib.trace_open(args.trace.encode()) != 0:
            sys.exit(f"record_trace: cannot open {args.trace}")
        allocator = torch.cuda.memory.CUDAPluggableAllocator(args.lib, "trace_malloc", "trace_free")
        torch.cuda.memory.change_current_allocator(allocator)
    elif args.mode == "gpupool":
        sys.path.insert(0, HERE)
        import gpupool_torch
        import torch

        gpupool_torch.install(args.lib)
    else:
        import torch
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode fills every new tensor with NaN: a cost per allocation that would
        # hide the allocators' difference, and the workloads read nothing uninitialised.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    t0 = time.perf_counter()
    info = globals()[args.workload](args.passes)
    torch.cuda.synchronize()
    ends = [t0] + _PASS_ENDS
    result = dict(info, seconds=time.perf_counter() - t0, torch=torch.__version__, digest=_DIGEST.hexdigest(),
                  pass_seconds=[b - a for a, b in zip(ends, ends[1:])],
                  gpu=torch.cuda.get_device_name(0),
                  conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if args.mode == "record":
        n = lib.trace_close()
        if n < 0:
            sys.exit(f"record_trace: writing {args.trace} failed")
        result["events"] = n
    elif args.mode == "gpupool":
        stats = gpupool_torch.stats()
        result.update(reserved_peak=stats["reserved_bytes.all.peak"],
                      requested_peak=stats.get("requested_bytes.all.peak"),
                      allocated_peak=stats.get("allocated_bytes.all.peak"),
                      num_device_alloc=stats.get("num_device_alloc"))
    else:
        stats = torch.cuda.memory_stats()
        segments = torch.cuda.memory_snapshot()
        result.update(reserved_peak=torch.cuda.max_memory_reserved(),
                      requested_peak=stats.get("requested_bytes.all.peak"),
                      allocated_peak=stats.get("allocated_bytes.all.peak"),
                      num_device_alloc=stats.get("num_device_alloc"),
                      expandable=any(s.get("is_expandable", False) for s in segments))
    with open(args.result, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------
# The parent: build the recorder, run the children, summarise

def find_cudart():
    """The libcudart to link trace_alloc against: the toolkit's, else the one PyTorch ships."""
    cuda = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    for d in ("lib64", "lib", "targets/x86_64-linux/lib"):
        path = os.path.join(cuda, d, "libcudart.so")
        if os.path.exists(path):
            return path
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so*")))
    if found:
        return found[-1]
    sys.exit("record_trace: no libcudart.so found (set CUDA_HOME)")


def build_recorder(out_dir):
    so = os.path.join(out_dir, "libtrace_alloc.so")
    cudart = find_cudart()
    cmd = ["gcc", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-o", so, os.path.join(HERE, "trace_alloc.c"),
           cudart, f"-Wl,-rpath,{os.path.dirname(cudart)}", "-lpthread"]
    subprocess.run(cmd, check=True)
    return so


def live_peak(path):
    """Events and the peak of the sum of live requested sizes, from a trace."""
    live, cur, peak, events = {}, 0, 0, 0
    with open(path) as f:
        for line in f:
            part = line.split()
            events += 1
            if part[0] == "a":
                size = int(part[2])
                live[part[1]] = size
                cur += size
                peak = max(peak, cur)
            else:
                cur -= live.pop(part[1], 0)
    return events, peak


def run_child(workload, mode, args, lib, env_extra):
    result = os.path.join(args.out, f"{workload}-{mode}.json")
    log = os.path.join(args.out, f"{workload}-{mode}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, "--mode", mode, "--passes",
           str(args.passes[workload]), "--result", result]
    if mode == "record":
        cmd += ["--lib", lib, "--trace", os.path.join(args.out, f"{workload}.txt")]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(env_extra)
    with open(log, "w") as f:
        r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        print(f"record_trace: {workload} ({mode}) failed with {r.returncode}; see {log}", file=sys.stderr)
        return None
    with open(result) as f:
        return json.load(f)


def mib(x):
    return f"{x / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for the traces, logs and the table")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="a tenth of the passes")
    ap.add_argument("--keep-text", action="store_true", help="keep NAME.txt beside NAME.txt.gz")
    ap.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["record", "native", "gpupool"], help=argparse.SUPPRESS)
    ap.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--passes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.workload = args.child
        child(args)
        return
    if not args.out:
        ap.error("--out is required")
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w} (known: {', '.join(WORKLOADS)})")
    args.passes = {w: max(1, PASSES[w] // 10) if args.quick else PASSES[w] for w in WORKLOADS}
    os.makedirs(args.out, exist_ok=True)
    lib = build_recorder(args.out)

    rows, failed = [], False
    for w in workloads:
        print(f"record_trace: {w}", file=sys.stderr, flush=True)
        rec = run_child(w, "record", args, lib, {})
        native = run_child(w, "native", args, lib, {})
        expandable = run_child(w, "native", args, lib, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        if rec is None or native is None or expandable is None:
            failed = True
            continue
        text = os.path.join(args.out, f"{w}.txt")
        events, peak = live_peak(text)
        with open(text, "rb") as src, gzip.open(text + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        if not args.keep_text:
            os.remove(text)
        if not expandable["expandable"]:
            print(f"record_trace: {w}: PyTorch made no expandable segment with expandable_segments:True",
                  file=sys.stderr)
            failed = True
        rows.append((w, rec, native, expandable, events, peak))

    lines = [f"Recorded with PyTorch {rows[0][1]['torch']} on {rows[0][1]['gpu']}." if rows else "",
             "",
             "| trace | workload | events | live peak (sum of live requests) | PyTorch reserved peak | "
             "PyTorch `expandable_segments:True` reserved peak | PyTorch's requested peak, default / expandable |",
             "|---|---|---|---|---|---|---|"]
    for w, rec, native, expandable, events, peak in rows:
        desc = DESCRIPTION[w].format(n=args.passes[w])
        if rec.get("attn_implementation"):
            desc += f", attention {rec['attn_implementation']}"
        same = "" if native["requested_peak"] == peak == expandable["requested_peak"] else " (differs from the trace)"
        lines.append(f"| {w}.txt.gz | {desc} | {events:,} | {mib(peak)} | "
                     f"{native['reserved_peak'] / 2**20:.0f} MiB ({native['reserved_peak'] / peak:.2f}x) | "
                     f"{expandable['reserved_peak'] / 2**20:.0f} MiB ({expandable['reserved_peak'] / peak:.2f}x) | "
                     f"{mib(native['requested_peak'])} / {mib(expandable['requested_peak'])}{same} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "traces.md"), "w") as f:
        f.write(table + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
