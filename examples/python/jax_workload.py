"""A JAX training step and an inference loop with changing shapes, for comparing XLA's
allocators with and without gpupool's LD_PRELOAD shim (scripts/gpu.sh, section `jax`).

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_experimental_vmm_disabled=true \\
        LD_PRELOAD=.../libgpupool_preload.so python3 jax_workload.py

(Without the flag XLA maps its buffers with cuMemCreate/cuMemMap, which the shim does not serve
and counts as passed through: docs/preload.md, "What XLA calls, and what a JAX user sets".)

The allocator is chosen outside, by XLA's own variables (XLA_PYTHON_CLIENT_ALLOCATOR=platform,
cuda_async or unset for its preallocated BFC pool; XLA_PYTHON_CLIENT_PREALLOCATE). Prints
"result: ..." lines (the losses and the inference checksums, as float32 bit patterns, which must
be the same under every allocator when XLA's choices are deterministic: run with
XLA_FLAGS=--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true), then "time: ..." (wall
seconds of the whole run, and of the second half, after every shape was compiled) and
"peak_device_mib: ..." (the device's used memory at its highest, sampled by nvidia-smi every
20 ms, less its value before JAX started; the whole device's, so run nothing else on it).
"""

import os
import struct
import subprocess
import sys
import time


def sampler():
    """nvidia-smi polling the device's used memory (MiB), or None without nvidia-smi."""
    try:
        return subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "20", "-i", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def used_now():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


def bits(x):
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def main():
    base = used_now()
    smi = sampler()
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    widths = [1024, 2048, 2048, 2048, 10]
    params = []
    for i in range(len(widths) - 1):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (widths[i], widths[i + 1]), jnp.float32) / widths[i] ** 0.5,
                       jnp.zeros((widths[i + 1],), jnp.float32)))

    def forward(p, x):
        for w, b in p[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = p[-1]
        return x @ w + b

    def loss_fn(p, x, y):
        return jnp.mean((forward(p, x) - y) ** 2)

    @jax.jit
    def step(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return [(w - 0.01 * gw, b - 0.01 * gb) for (w, b), (gw, gb) in zip(p, g)], loss

    @jax.jit
    def infer(p, x):
        # Attention-like work whose buffers scale with the sequence length.
        h = forward(p, x)
        s = jnp.einsum("bsd,btd->bst", x, x) / x.shape[-1]
        return h.sum() + jax.nn.softmax(s, axis=-1).sum()

    results = []
    half = None
    for i in range(60):
        key, kx, ky = jax.random.split(key, 3)
        x = jax.random.normal(kx, (512, widths[0]), jnp.float32)
        y = jax.random.normal(ky, (512, widths[-1]), jnp.float32)
        params, loss = step(params, x, y)
        results.append(bits(loss))
    shapes = [(b, s) for b in (1, 4, 16) for s in (64, 256, 1024)]
    for i in range(240):
        if i == 120:
            jax.block_until_ready(params)
            half = time.perf_counter()
        b, s = shapes[(i * 7) % len(shapes)]
        key, kx = jax.random.split(key)
        x = jax.random.normal(kx, (b, s, widths[0]), jnp.float32)
        results.append(bits(infer(params, x)))
    end = time.perf_counter()
    if smi is not None:
        smi.terminate()
        samples = [int(v) for v in smi.communicate()[0].split() if v.isdigit()]
    else:
        samples = []
    print("result:", " ".join(f"{r:08x}" for r in results))
    print(f"time: total {end - t0:.3f} s, second half of the inference loop {end - half:.3f} s")
    if base is not None and samples:
        print(f"peak_device_mib: {max(samples) - base} (device used at its highest {max(samples)} MiB, before {base} MiB)")
    print("platform:", jax.devices()[0].platform, "allocator:", os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
          "preload:", "yes" if "gpupool" in os.environ.get("LD_PRELOAD", "") else "no")
    return 0


if __name__ == "__main__":
    sys.exit(main())
