"""gpupool.cupy on the simulated device (docs/cupy.md).

CuPy cannot allocate without a GPU, so `cupy` here is the stand-in of fake_cupy.py, which
calls what it is given as CuPy 14 does: the compiled hook through its address with the GIL
held, an exception the hook left pending raised, and the stream getter through a
`__pyx_capi__` capsule. Where the real CuPy is installed (it imports without a GPU), its own
Cython classes call the hook too (CFunctionAllocatorMemory, PythonFunctionAllocatorMemory) and
its capsule is checked. The interpreter-exit tests run fresh interpreters that keep blocks
alive at exit under each route and must exit 0 with nothing on stderr. The real CuPy on a GPU
runs in scripts/gpu.sh's plugins and cupy sections.
"""

import ctypes
import gc
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

import fake_cupy
import gpupool
import gpupool.cupy as gcupy

MIB = 1 << 20
HERE = pathlib.Path(__file__).resolve().parent
HOOK_MALLOC = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
HOOK_FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)


def _allocated(device=0):
    return gpupool.stats(device)["allocated_bytes.all.current"]


@pytest.fixture
def fake(monkeypatch):
    """The stand-in CuPy, with its stream getter's capsule; `fake.make(...)` replaces it."""
    monkeypatch.setattr(gcupy, "_warned", False)

    class Fake:
        def make(self, stream=0x51, **kw):
            self.cupy, self.backends, self.state = fake_cupy.make(stream, **kw)
            fake_cupy.install_modules(lambda k, v: monkeypatch.setitem(sys.modules, k, v), self.cupy, self.backends)
            return self

    f = Fake().make()
    yield f
    gcupy._route = None


def test_install_takes_the_compiled_hook_and_follows_the_current_stream(fake):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        allocator = gcupy.install()
    assert gcupy.route() == "hook"
    lib = gpupool._lib.lib()
    assert allocator.malloc_address == ctypes.cast(lib.gpupool_cupy_hook_malloc, ctypes.c_void_p).value
    assert allocator.free_address == ctypes.cast(lib.gpupool_cupy_hook_free, ctypes.c_void_p).value
    malloc = fake.state["allocator"]
    before = _allocated()
    a = malloc(3 * MIB)
    assert _allocated() == before + 3 * MIB
    ptr = a.ptr
    del a
    gc.collect()
    assert _allocated() == before
    # Freed on stream 0x51: CuPy's next array on 0x51 gets the block, one on 0x52 does not.
    b = malloc(3 * MIB)
    assert b.ptr == ptr
    fake.state["stream"] = 0x52
    c = malloc(3 * MIB)
    assert c.ptr != ptr
    p = c.ptr
    del c
    assert gpupool.malloc(3 * MIB, 0, 0x52) == p  # c's block went back to 0x52's cache
    gpupool.free(p)
    del b


def test_hook_raises_cupy_and_gpupool_out_of_memory(fake):
    gcupy.install()
    before = _allocated()
    with pytest.raises(fake.cupy.cuda.memory.OutOfMemoryError) as info:
        fake.state["allocator"](64 << 30)
    e = info.value
    assert isinstance(e, gpupool.OutOfMemoryError) and isinstance(e, MemoryError)
    assert e.status == gpupool._lib.OUT_OF_MEMORY and e.call == "gpupool_cupy_hook_malloc"
    assert "out of memory" in e.message.lower() and str(e).startswith("gpupool_cupy_hook_malloc failed")
    assert _allocated() == before
    # Another failure (a device that does not exist) raises HookError, a gpupool.Error.
    with pytest.raises(gcupy.HookError) as info:
        fake.state["allocator"](MIB, device=7)
    assert info.value.status == gpupool._lib.INVALID_VALUE and "device 7" in info.value.message
    assert fake.state["allocator"](MIB).ptr  # the hook still works afterwards


def test_hook_passes_on_the_getters_exception(fake):
    # A getter that fails as CuPy's does (an exception set, a value returned): PyErr_NoMemory,
    # which returns NULL with MemoryError set. The hook allocates nothing and leaves it pending.
    fake.make(getter_address=ctypes.cast(ctypes.pythonapi.PyErr_NoMemory, ctypes.c_void_p).value)
    gcupy.install()
    assert gcupy.route() == "hook"
    before = _allocated()
    with pytest.raises(MemoryError) as info:
        fake.state["allocator"](MIB)
    assert not isinstance(info.value, gpupool.Error)
    assert _allocated() == before


@pytest.mark.parametrize("capsule_name", [None, b"intptr_t (int)"])
def test_without_the_capsule_the_python_route_with_one_warning(fake, capsule_name):
    fake.make(capsule_name=capsule_name)
    assert gcupy.stream_getter() == (None, None)
    with pytest.warns(RuntimeWarning, match="get_current_stream_ptr"):
        gcupy.install()
    assert gcupy.route() == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gcupy.install()  # warned once only
    malloc = fake.state["allocator"]
    a = malloc(2 * MIB)
    ptr = a.ptr
    del a
    assert gpupool.malloc(2 * MIB, 0, 0x51) == ptr  # filed under CuPy's current stream
    gpupool.free(ptr)
    with pytest.raises(fake.cupy.cuda.memory.OutOfMemoryError) as info:
        malloc(64 << 30)
    assert isinstance(info.value, gpupool.OutOfMemoryError)
    with pytest.raises(RuntimeError, match="compiled=True"):
        gcupy.install(compiled=True)


def test_a_library_without_the_hook_gets_the_older_routes(fake, monkeypatch):
    real = gpupool._lib.lib()

    class OlderLibrary:  # a libgpupool from before the hook (an older LD_PRELOAD shim's)
        def __getattr__(self, name):
            if name.startswith("gpupool_cupy_hook"):
                raise AttributeError(name)
            return getattr(real, name)

    monkeypatch.setattr(gpupool._lib, "lib", lambda: OlderLibrary())
    with pytest.warns(RuntimeWarning, match="no gpupool_cupy_hook_malloc"):
        gcupy.install()
    assert gcupy.route() == "python"
    gcupy.install(stream=0x64)
    assert gcupy.route() == "stream"
    assert fake.state["allocator"].__self__.malloc_address == ctypes.cast(real.gpupool_cupy_malloc, ctypes.c_void_p).value
    a = fake.state["allocator"](MIB)
    ptr = a.ptr
    del a
    assert gpupool.malloc(MIB, 0, 0x64) == ptr
    gpupool.free(ptr)


def test_python_route_on_request(fake):
    gcupy.install(compiled=False)
    assert gcupy.route() == "python"
    fake.state["stream"] = 0x53
    a = fake.state["allocator"](MIB)
    ptr = a.ptr
    del a
    assert gpupool.malloc(MIB, 0, 0x53) == ptr
    gpupool.free(ptr)


def test_fixed_stream_through_the_hook(fake):
    class Stream:
        ptr = 0x61

    gcupy.install(stream=Stream())
    assert gcupy.route() == "stream"
    malloc = fake.state["allocator"]
    fake.state["stream"] = 0x62  # CuPy's current stream is not read
    a = malloc(2 * MIB)
    ptr = a.ptr
    del a
    assert gpupool.malloc(2 * MIB, 0, 0x61) == ptr  # filed under the stream given
    gpupool.free(ptr)
    with pytest.raises(gpupool.OutOfMemoryError):
        malloc(64 << 30)


def test_hook_free_and_null_param(capfd):
    lib = gpupool._lib.lib()
    hook_malloc = HOOK_MALLOC(ctypes.cast(lib.gpupool_cupy_hook_malloc, ctypes.c_void_p).value)
    hook_free = HOOK_FREE(ctypes.cast(lib.gpupool_cupy_hook_free, ctypes.c_void_p).value)
    capfd.readouterr()
    hook_free(None, ctypes.c_void_p(-1 & ((1 << 64) - 1)), 0)  # the raised marker: nothing
    hook_free(None, None, 0)
    assert capfd.readouterr().err == ""
    # NULL param: no exception can be raised; NULL and gpupool's message on stderr.
    assert hook_malloc(None, MIB, 0) is None
    assert "param is NULL" in capfd.readouterr().err
    local = ctypes.c_uint64()
    hook_free(None, ctypes.addressof(local), 0)  # not gpupool's: refused, nothing changes
    assert "gpupool_cupy_hook_free" in capfd.readouterr().err


def test_pinned_memory(fake):
    gcupy.install()
    before = gpupool.host_stats()
    p = fake.state["pinned"](50_000)
    assert p.ptr and p.mem.size == 50_000
    assert gpupool.host_stats()["active_requests.current"] == before["active_requests.current"] + 1
    del p
    gc.collect()
    assert gpupool.host_stats()["active_requests.current"] == before["active_requests.current"]
    gcupy.uninstall()
    assert gcupy.route() is None
    assert fake.state["allocator"] == "cupy's pool" and fake.state["pinned"] == "cupy's pinned pool"


# The real CuPy, where installed ----------------------------------------------------------------

def _real_cupy():
    try:
        import cupy.cuda.memory  # noqa: F401
        return sys.modules["cupy"]
    except Exception as e:  # noqa: BLE001 (not installed, or broken without CUDA's libraries)
        pytest.skip(f"cupy not importable here: {e}")


def test_real_cupy_exports_the_getter_and_runs_the_hook():
    cupy = _real_cupy()
    address, where = gcupy.stream_getter()
    assert address and where == "cupy_backends.cuda.stream.get_current_stream_ptr"
    # CuPy's own Cython (CFunctionAllocatorMemory, as CFunctionAllocator.malloc makes it) calls
    # the hook; the getter here is ours, since CuPy's needs a driver.
    stream = {"ptr": 0x71}
    getter = fake_cupy.GETTER(lambda: stream["ptr"])
    hook = gpupool._structs.CupyHook()
    hook.current_stream = ctypes.cast(getter, ctypes.c_void_p).value
    hook.err_occurred = gcupy._address(ctypes.pythonapi.PyErr_Occurred)
    hook.err_set_string = gcupy._address(ctypes.pythonapi.PyErr_SetString)
    oom = gcupy.out_of_memory_type(cupy)
    hook.out_of_memory, hook.error = id(oom), id(gcupy.HookError)
    lib = gpupool._lib.lib()
    args = (ctypes.addressof(hook), gcupy._address(lib.gpupool_cupy_hook_malloc),
            gcupy._address(lib.gpupool_cupy_hook_free))
    Memory = cupy.cuda.memory.CFunctionAllocatorMemory
    before = _allocated()
    a = Memory(4 * MIB, *args, 0)
    assert _allocated() == before + 4 * MIB
    ptr = a.ptr
    del a
    assert _allocated() == before
    assert Memory(4 * MIB, *args, 0).ptr == ptr  # freed and taken again on 0x71
    stream["ptr"] = 0x72
    b = Memory(4 * MIB, *args, 0)
    assert b.ptr != ptr
    # Out of memory raises through CuPy 14's own check of _call_malloc (except? -1).
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        Memory(64 << 30, *args, 0)
    assert isinstance(info.value, gpupool.OutOfMemoryError)
    # CuPy's own getter: a stream on a GPU machine, CuPy's CUDARuntimeError without a driver.
    hook.current_stream = address
    try:
        c = Memory(MIB, *args, 0)
    except Exception as e:  # noqa: BLE001
        assert not isinstance(e, (SystemError, gpupool.Error)), e
    else:
        assert c.ptr
    del b


# Interpreter exit -------------------------------------------------------------------------------

EXIT_PROGRAM = r"""
import ctypes, sys, threading
sys.path.insert(0, sys.argv[2])
import gpupool, gpupool.cupy
route = sys.argv[1]
gpupool.record_history(True, "all", 100000, stacks="python")
MIB = 1 << 20
if route.startswith("cupy-real"):
    import cupy
    lib = gpupool._lib.lib()
    if route == "cupy-real-python":
        free = gpupool.cupy._python_route(cupy, lib)[1]
        make = lambda: cupy.cuda.memory.PythonFunctionAllocatorMemory(
            MIB, lambda s, d: gpupool.malloc(s, d, 0x51), free, 0)
    else:
        hook = gpupool._structs.CupyHook()
        hook.stream = 0x51
        args = (ctypes.addressof(hook), gpupool.cupy._address(lib.gpupool_cupy_hook_malloc),
                gpupool.cupy._address(lib.gpupool_cupy_hook_free))
        make = lambda: cupy.cuda.memory.CFunctionAllocatorMemory(MIB, *args, 0)
    holder = cupy
elif route.startswith("cupy"):
    import fake_cupy
    cupy, backends, state = fake_cupy.make(0x51)
    fake_cupy.install_modules(sys.modules.__setitem__, cupy, backends)
    gpupool.cupy.install(compiled=(route == "cupy-hook"))
    assert gpupool.cupy.route() == ("hook" if route == "cupy-hook" else "python")
    make = lambda: state["allocator"](MIB)
    pinned = [state["pinned"](4096) for _ in range(4)]
    holder = cupy
elif route == "torch":
    # PyTorch's pluggable allocator frees a tensor's storage from C++ (gpupool_torch_free) when
    # the tensor dies, late in the teardown for one held by a module.
    lib = ctypes.CDLL(gpupool._lib.bound_path() or None)
    t_malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(("gpupool_torch_malloc", lib))
    t_free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(("gpupool_torch_free", lib))
    class Storage:
        def __init__(self, f=t_free):
            self.ptr, self.f = t_malloc(MIB, 0, 0x51), f
        def __del__(self):
            self.f(self.ptr, MIB, 0, 0x51)
    make = Storage
    holder = threading
else:  # the bare package: blocks never freed, pinned memory, a pool
    make = lambda: gpupool.malloc(MIB, 0, 0x51)
    pinned = [gpupool.host_malloc(4096) for _ in range(4)]
    pool = gpupool.Pool()
    holder = gpupool
blocks = [make() for _ in range(16)]
# Held where the teardown reaches late: sys, a module, a reference cycle, a thread's locals.
sys._gpupool_blocks = blocks[:4]
holder._gpupool_blocks = blocks[4:8]
tls = threading.local(); tls.blocks = blocks[12:]
if route != "cupy-real-python":
    # Not CuPy's PythonFunctionAllocatorMemory: the collector clears its free function (it is
    # GC-tracked, unlike CFunctionAllocatorMemory) before CuPy frees the block (docs/cupy.md).
    class Cycle: pass
    c = Cycle(); c.me = c; c.blocks = blocks[8:12]
    del c
del blocks
print("exiting", flush=True)
"""

EXIT_ROUTES = ["bare", "torch", "cupy-python", "cupy-hook", "cupy-real-python", "cupy-real-hook"]


@pytest.mark.parametrize("route", EXIT_ROUTES)
def test_exit_with_blocks_alive_is_silent(route, tmp_path):
    if route.startswith("cupy-real"):
        _real_cupy()
    script = tmp_path / "exit.py"
    script.write_text(EXIT_PROGRAM)
    for run in range(3):
        p = subprocess.run([sys.executable, str(script), route, str(HERE)], env=dict(os.environ),
                           capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout, p.stderr) == (0, "exiting\n", ""), f"run {run}"
