"""PyTorch on gpupool, fallback and unsplit pools (scripts/gpu.sh's `torch_fallback` section;
docs/graphs.md, "Fallback and unsplit pools"):

    python3 tests/gpu/torch_fallback.py [--lib libgpupool.so]

First reports what torch.cuda.MemPool(use_on_oom=True) and MemPool(no_split=True) do under
gpupool's pluggable allocator (gpupool receives neither flag; the line says whether PyTorch
raises or accepts them). Then a gpupool.Pool(use_on_oom=True) holds a 20 MiB segment with a
4 MiB tensor kept and 16 MiB cached (filled through gpupool.torch.use_pool); the GPU is filled
with default-pool tensors (1 GiB, then 64 MiB, then 2 MiB, each until out of memory or until the
fallback pool serves one, which is given back); an 8 MiB
tensor on the same stream must then be served by the fallback pool (its allocated bytes up by
8 MiB, the device's num_ooms unchanged by it) and go back to it when deleted. A
gpupool.Pool(no_split=True) must hand a 512-byte tensor a whole 2 MiB block. Prints one line
per check and "torch_fallback: N passed, M failed"; exits 1 when a check failed.
"""

import argparse
import sys

import torch

import gpupool
import gpupool.torch

MIB = 1 << 20
results = []


def check(ok, what):
    results.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)


def allocated(pool):
    return pool.stats()["allocated_bytes.all.current"]


def fill(sizes, spare):
    """Default-pool tensors of each size until out of memory. The fallback pool serves what
    the default pools cannot: a tensor it served (its allocated bytes rose) is given back and
    ends that size, so the fill leaves the fallback pool as it was (the first GPU run, 2026-11-29,
    filled it too and then found nothing left for the 8 MiB tensor)."""
    held = []
    before = allocated(spare)
    for size in sizes:
        while True:
            try:
                t = torch.empty(size, dtype=torch.uint8, device="cuda")
                # PyTorch 2.11 does not check its pluggable allocator's NULL (docs/pytorch.md):
                # out of memory is a tensor without storage, not an exception.
                if t.data_ptr() == 0:
                    break
                if allocated(spare) != before:
                    del t
                    break
                held.append(t)
            except torch.cuda.OutOfMemoryError:
                break
            except RuntimeError as e:  # a NULL from the pluggable allocator, in older PyTorch
                if "out of memory" not in str(e).lower():
                    raise
                break
    return held


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=None, help="the libgpupool.so to install (else the package's)")
    args = ap.parse_args()
    gpupool.torch.install(args.lib)
    torch.cuda.init()
    for kw in ({"use_on_oom": True}, {"no_split": True}):
        try:
            torch.cuda.MemPool(**kw)
            print(f"INFO: torch.cuda.MemPool({kw}) accepted under the pluggable allocator (gpupool does not see it)")
        except Exception as e:  # noqa: BLE001 (reported, not a failure)
            print(f"INFO: torch.cuda.MemPool({kw}) raised {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    whole = gpupool.Pool(device=0, no_split=True)
    with gpupool.torch.use_pool(whole):
        t = torch.empty(512, dtype=torch.uint8, device="cuda")
    check(allocated(whole) == 2 * MIB, f"no_split: a 512 B tensor holds a whole 2 MiB block ({allocated(whole)})")
    del t
    spare = gpupool.Pool(device=0, use_on_oom=True)
    with gpupool.torch.use_pool(spare):
        kept = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
        gone = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    del gone
    check(allocated(spare) == 4 * MIB, "the fallback pool holds 4 MiB, 16 MiB cached")
    held = fill([1 << 30, 64 * MIB, 2 * MIB], spare)
    check(allocated(spare) == 4 * MIB, f"the fill left the fallback pool as it was ({allocated(spare)})")
    free, _ = torch.cuda.mem_get_info()
    print(f"INFO: filled with {len(held)} tensors, {free / MIB:.1f} MiB free on the device")
    ooms = gpupool.torch.stats()["num_ooms"]
    try:
        x = torch.empty(8 * MIB, dtype=torch.uint8, device="cuda")
        check(allocated(spare) == 12 * MIB, f"the 8 MiB tensor is the fallback pool's ({allocated(spare)})")
        check(gpupool.torch.stats()["num_ooms"] == ooms, "no out-of-memory counted for it")
        del x
        check(allocated(spare) == 4 * MIB, "freed back to the fallback pool")
    except Exception as e:  # noqa: BLE001
        check(False, f"the 8 MiB tensor: {type(e).__name__}: {e}")
    del held, kept
    spare.release()
    whole.release()
    passed = sum(results)
    print(f"torch_fallback: {passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
