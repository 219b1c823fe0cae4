"""The frameworks' plug-ins on the simulated device.

- ONNX Runtime: the three functions whose addresses provider_options() hands ONNX Runtime,
  called through those addresses with ONNX Runtime's signatures.
- CuPy: test_cupy.py.
- Numba: the real numba-cuda when installed (CI installs it), without a GPU: the EMM plugin
  is accepted by numba.cuda.set_memory_manager and by NUMBA_CUDA_MEMORY_MANAGER, and its
  methods, given a stand-in context, allocate from gpupool and give back when Numba drops the
  memory. Skipped when numba-cuda is not installed.
"""

import ctypes
import gc
import os
import subprocess
import sys
import types

import pytest

import gpupool

MIB = 1 << 20


# ONNX Runtime ---------------------------------------------------------------------------------

def test_ort_options_call_gpupool_with_ort_signatures():
    opts = gpupool.onnxruntime.provider_options(device_id=0)
    assert opts["device_id"] == "0"
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(int(opts["gpu_external_alloc"]))
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(int(opts["gpu_external_free"]))
    empty = ctypes.CFUNCTYPE(None)(int(opts["gpu_external_empty_cache"]))
    gpupool.empty_cache(0)
    before = gpupool.stats(0)
    p = alloc(6 * MIB)
    assert p
    assert gpupool.stats(0)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 6 * MIB
    free(p)
    assert alloc(6 * MIB) == p  # reused on ONNX Runtime's stream
    free(p)
    free(None)
    local = ctypes.c_uint64()
    free(ctypes.addressof(local))  # refused, on stderr; nothing changes
    assert gpupool.stats(0)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert gpupool.stats(0)["reserved_bytes.all.current"] > before["reserved_bytes.all.current"]
    empty()
    assert gpupool.stats(0)["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    assert alloc(64 << 30) is None  # out of memory: NULL, which ONNX Runtime turns into an error


def test_ort_stream_option():
    opts = gpupool.onnxruntime.provider_options(stream=0x77)
    assert opts["user_compute_stream"] == str(0x77) and opts["has_user_compute_stream"] == "1"
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(int(opts["gpu_external_alloc"]))
    p = alloc(MIB)
    gpupool.free(p)
    # The block is filed under stream 0x77: a malloc for that stream gets it back, and the
    # legacy default stream does not.
    assert gpupool.malloc(MIB, -1, 0x77) == p
    q = gpupool.malloc(MIB, -1, 0)
    assert q != p
    gpupool.free(p)
    gpupool.free(q)
    gpupool.onnxruntime.set_stream(None)


# Numba ----------------------------------------------------------------------------------------

def _numba_cuda():
    try:
        from numba import cuda  # noqa: F401
        return cuda
    except Exception as e:  # noqa: BLE001 (numba missing, or numba.cuda without its runtime)
        pytest.skip(f"numba.cuda not importable here: {e}")


class _Context:
    """What the EMM plugin reads of Numba's context: its device's ordinal."""

    device = types.SimpleNamespace(id=1)


def test_numba_plugin_is_accepted():
    cuda = _numba_cuda()
    import gpupool.numba as plugin

    cuda.set_memory_manager(plugin.GpupoolNumbaManager)
    from numba.cuda.cudadrv import driver

    assert driver._memory_manager is plugin.GpupoolNumbaManager
    # NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba, as Numba reads it, in a fresh process.
    code = ("from numba.cuda.cudadrv import driver; driver._ensure_memory_manager(); "
            "print(driver._memory_manager.__module__, driver._memory_manager.__name__)")
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="gpupool.numba")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["gpupool.numba", "GpupoolNumbaManager"]


def test_numba_memalloc_and_pinned_from_gpupool():
    _numba_cuda()
    import gpupool.numba as plugin

    mm = plugin.GpupoolNumbaManager(context=_Context())
    mm.initialize()
    assert mm.interface_version == 1
    before = gpupool.stats(1)
    mem = mm.memalloc(5 * MIB)
    assert mem.size == 5 * MIB
    ptr = int(mem.device_pointer)
    s = gpupool.stats(1)
    assert s["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 5 * MIB
    del mem
    gc.collect()
    assert gpupool.stats(1)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert gpupool.malloc(5 * MIB, 1, 0) == ptr  # filed under the default stream
    gpupool.free(ptr)
    empty = mm.memalloc(0)
    assert int(empty.device_pointer) != 0
    del empty
    with pytest.raises(gpupool.OutOfMemoryError):
        mm.memalloc(64 << 30)
    host_before = gpupool.host_stats()
    pinned = mm.memhostalloc(10_000)
    assert pinned.size == 10_000
    assert gpupool.host_stats()["active_requests.current"] == host_before["active_requests.current"] + 1
    ctypes.memset(pinned.host_pointer, 3, 10_000)
    del pinned
    gc.collect()
    assert gpupool.host_stats()["active_requests.current"] == host_before["active_requests.current"]


def test_numba_defer_cleanup_and_reset():
    _numba_cuda()
    import gpupool.numba as plugin

    mm = plugin.GpupoolNumbaManager(context=_Context())
    before = gpupool.stats(1)["allocated_bytes.all.current"]
    with mm.defer_cleanup():
        with mm.defer_cleanup():
            mem = mm.memalloc(MIB)
            del mem
            gc.collect()
        assert gpupool.stats(1)["allocated_bytes.all.current"] == before + MIB
    assert gpupool.stats(1)["allocated_bytes.all.current"] == before
    assert gpupool.stats(1)["reserved_bytes.all.current"] > 0
    mm.reset()
    assert gpupool.stats(1)["reserved_bytes.all.current"] == 0
