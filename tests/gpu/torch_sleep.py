"""PyTorch on gpupool, sleep and wake (scripts/gpu.sh's `torch_sleep` section; docs/sleep.md):

    python3 tests/gpu/torch_sleep.py [--lib libgpupool.so] [--tokens N]

A transformers Llama decoder built from a config with a fixed seed (nothing downloaded) has its
weights in one gpupool pool (loaded under gpupool.torch.use_pool) and its generation state
(KV cache, activations, cuBLAS workspace) in another; it generates greedily, then both pools
sleep (weights offloaded, generation state discarded): the device's free memory
(torch.cuda.mem_get_info) must rise by at least what the two pools held (their reserved
bytes). Both wake; the weights must be the same bit for bit (SHA-256 of every parameter's
bytes) and a second generation must give the same token ids. Prints one line per check and
"torch_sleep: N passed, M failed"; exits 1 when a check failed. Needs torch and transformers,
and the gpupool package importable (scripts/gpu.sh puts the installed prefix's copy on
PYTHONPATH).
"""

import argparse
import hashlib
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch  # noqa: E402

import gpupool  # noqa: E402
import gpupool.torch  # noqa: E402

results = []


def check(ok, what):
    results.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)


def weights_hash(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def generate(model, new_tokens):
    gen = torch.Generator().manual_seed(2)
    tokens = []
    with torch.no_grad():
        for batch in (2, 6):
            ids = torch.randint(1, 8000, (batch, 32), generator=gen).to("cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
            tokens.append(out.tolist())
            del out, ids
    torch.cuda.synchronize()
    return tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=None, help="the libgpupool.so to install (else the package's)")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    gpupool.torch.install(args.lib)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    mib = 1 << 20
    weights, state = gpupool.Pool(sleepable=True), gpupool.Pool(sleepable=True)
    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    with gpupool.torch.use_pool(weights):
        model = model.to("cuda")
    torch.cuda.synchronize()
    before = weights_hash(model)
    with gpupool.torch.use_pool(state):
        first = generate(model, args.tokens)
    w, s = weights.stats(), state.stats()
    check(w["allocated_bytes.all.current"] >= sum(p.numel() * p.element_size() for p in model.parameters()),
          f"the weights are in their pool ({w['allocated_bytes.all.current'] / mib:.1f} MiB allocated)")
    check(s["allocation.all.allocated"] > 0,
          f"the generation allocated from its pool ({s['allocation.all.allocated']} allocations, "
          f"{s['reserved_bytes.all.current'] / mib:.1f} MiB reserved)")
    held = w["reserved_bytes.all.current"] + s["reserved_bytes.all.current"]
    # The process's first sleep and wake pin the staging ring and make its streams and events,
    # which may take device memory of CUDA's own (as a first graph or kernel launch does,
    # ../shared/GPU.md): done once on a pool of 1 MiB, before the count, and what it left said
    # beside what gpupool holds unmapped for reuse (the pool's page, once it was released).
    free_cold = torch.cuda.mem_get_info()[0]
    with gpupool.Pool(sleepable=True) as warm:
        with gpupool.torch.use_pool(warm):
            block = torch.ones(1 << 18, device="cuda")
        gpupool.torch.sleep(warm, offload=True)
        gpupool.torch.wake(warm)
        del block
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    unmapped = gpupool.stats(torch.cuda.current_device())["unmapped_held_bytes.current"]
    print(f"the first sleep and wake of the process, on a pool of 1 MiB since released: device free memory "
          f"{(free_awake - free_cold) / mib:+.2f} MiB, gpupool holding {unmapped / mib:.2f} MiB of pages unmapped")
    gpupool.torch.sleep(weights, offload=True)
    gpupool.torch.sleep(state, offload=False)
    free_asleep = torch.cuda.mem_get_info()[0]
    sleeping = gpupool.stats(torch.cuda.current_device())["sleeping_bytes.current"]
    check(free_asleep - free_awake >= held and sleeping == held,
          f"asleep: device free memory up {(free_asleep - free_awake) / mib:.2f} MiB, the pools held "
          f"{held / mib:.2f} MiB, {sleeping / mib:.2f} MiB sleeping")
    # Through gpupool's own call: PyTorch does not check a NULL from a pluggable allocator.
    try:
        with gpupool.torch.use_pool(state):
            gpupool.free(gpupool.malloc(1024, torch.cuda.current_device()))
        refused = False
    except gpupool.Error:
        refused = True
    check(refused, "a sleeping pool refuses an allocation routed to it")
    gpupool.torch.wake(state)
    gpupool.torch.wake(weights)
    free_woken = torch.cuda.mem_get_info()[0]
    check(weights_hash(model) == before, "after wake every weight is the same bit for bit")
    with gpupool.torch.use_pool(state):
        second = generate(model, args.tokens)
    same = first == second
    check(same, f"the second generation gives the same {sum(len(t) * len(t[0]) for t in first)} token ids"
          f" (device free memory down {(free_asleep - free_woken) / mib:.2f} MiB at wake)")
    del model
    torch.cuda.synchronize()
    passed = sum(results)
    print(f"torch_sleep: {passed} passed, {len(results) - passed} failed", flush=True)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
