"""The frameworks' plug-ins on the simulated device.

- ONNX Runtime: the three functions whose addresses provider_options() hands ONNX Runtime,
  called through those addresses with ONNX Runtime's signatures.
- CuPy: cupy cannot allocate without a GPU, so `cupy` here is a stand-in module with the
  names gpupool.cupy calls (set_allocator, PythonFunctionAllocator, CFunctionAllocator,
  get_current_stream, set_pinned_memory_allocator, PinnedMemoryPointer) that calls what it is
  given as CuPy does (the C functions through their addresses, with CuPy's signatures). The
  real CuPy runs in scripts/gpu.sh's plugins section.
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


# CuPy -----------------------------------------------------------------------------------------

def _fake_cupy(current_stream):
    """A stand-in for the cupy names gpupool.cupy uses, behaving as CuPy 14 does."""
    cupy = types.ModuleType("cupy")
    state = {"allocator": None, "pinned": None, "stream": current_stream}

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__(f"Out of memory allocating {size:,} bytes")

    class Memory:
        def __init__(self, ptr, size, release):
            self.ptr, self.size, self._release = ptr, size, release

        def __del__(self):
            if self.ptr:
                self._release(self.ptr)

    class PythonFunctionAllocator:
        def __init__(self, malloc_func, free_func):
            self._malloc, self._free = malloc_func, free_func

        def malloc(self, size):
            device = 0
            ptr = self._malloc(size, device)
            return Memory(ptr, size, lambda p: self._free(p, device))

    class CFunctionAllocator:
        malloc_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        free_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

        def __init__(self, param, malloc_func, free_func, owner):
            self._param, self._owner = param, owner
            self._malloc = self.malloc_type(malloc_func)
            self._free = self.free_type(free_func)

        def malloc(self, size):
            ptr = self._malloc(self._param, size, 0) or 0  # CuPy 14 does not check for NULL
            return Memory(ptr, size, lambda p: self._free(self._param, p, 0))

    class PinnedMemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    cuda = types.SimpleNamespace(
        set_allocator=lambda a: state.__setitem__("allocator", a),
        set_pinned_memory_allocator=lambda a: state.__setitem__("pinned", a),
        get_current_stream=lambda: types.SimpleNamespace(ptr=state["stream"]),
        PinnedMemoryPointer=PinnedMemoryPointer,
        memory=types.SimpleNamespace(PythonFunctionAllocator=PythonFunctionAllocator,
                                     CFunctionAllocator=CFunctionAllocator,
                                     OutOfMemoryError=OutOfMemoryError),
    )
    cupy.cuda = cuda
    cupy.get_default_memory_pool = lambda: types.SimpleNamespace(malloc="cupy's pool")
    cupy.get_default_pinned_memory_pool = lambda: types.SimpleNamespace(malloc="cupy's pinned pool")
    return cupy, state


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy, state = _fake_cupy(0x51)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return state


def test_cupy_follows_the_current_stream(fake_cupy):
    gpupool.cupy.install()
    malloc = fake_cupy["allocator"]
    before = gpupool.stats(0)
    a = malloc(3 * MIB)
    assert gpupool.stats(0)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 3 * MIB
    ptr = a.ptr
    del a
    gc.collect()
    assert gpupool.stats(0)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    # Freed on stream 0x51: CuPy's next array on 0x51 gets the block, one on 0x52 does not.
    b = malloc(3 * MIB)
    assert b.ptr == ptr
    fake_cupy["stream"] = 0x52
    c = malloc(3 * MIB)
    assert c.ptr != ptr
    assert gpupool.malloc(3 * MIB, 0, 0x52) != c.ptr
    del b, c
    with pytest.raises(MemoryError, match="Out of memory allocating"):
        malloc(64 << 30)


def test_cupy_fixed_stream_through_c_functions(fake_cupy):
    class Stream:
        ptr = 0x61

    gpupool.cupy.install(stream=Stream())
    malloc = fake_cupy["allocator"]
    a = malloc(2 * MIB)
    ptr = a.ptr
    assert ptr
    del a
    assert gpupool.malloc(2 * MIB, 0, 0x61) == ptr  # filed under the stream given
    gpupool.free(ptr)
    # The C path returns NULL on failure, as CuPy's CFunctionAllocator expects of C code.
    assert malloc(64 << 30).ptr == 0


def test_cupy_pinned_memory(fake_cupy):
    gpupool.cupy.install()
    before = gpupool.host_stats()
    p = fake_cupy["pinned"](50_000)
    assert p.ptr and p.mem.size == 50_000
    assert gpupool.host_stats()["active_requests.current"] == before["active_requests.current"] + 1
    del p
    gc.collect()
    assert gpupool.host_stats()["active_requests.current"] == before["active_requests.current"]
    gpupool.cupy.uninstall()
    assert fake_cupy["allocator"] == "cupy's pool" and fake_cupy["pinned"] == "cupy's pinned pool"


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
