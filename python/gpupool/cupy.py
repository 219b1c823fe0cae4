"""gpupool as CuPy's allocator (docs/cupy.md).

    import cupy, gpupool
    gpupool.cupy.install()           # device memory on CuPy's current stream, and pinned memory
    ...
    gpupool.stats()                  # CuPy's blocks, with PyTorch's and the rest of the process's

install() calls cupy.cuda.set_allocator and cupy.cuda.set_pinned_memory_allocator. Each
allocation is made for CuPy's current stream, as CuPy's own MemoryPool keeps a free list per
stream: a block freed by work on one stream is reused on that stream only. CuPy's
CFunctionAllocator passes C functions only (param, size, device_id), so install() hands it
gpupool's compiled hook, gpupool_cupy_hook_malloc and gpupool_cupy_hook_free
(include/gpupool_plugins.h), and as `param` a gpupool_cupy_hook_t holding the address of
CuPy's own C getter of the current stream, get_current_stream_ptr, which Cython exports in
cupy_backends.cuda.stream.__pyx_capi__ (a capsule whose name is its signature, "intptr_t
(void)"). No Python frame runs per allocation or free: CuPy's Cython calls gpupool, which calls
CuPy's Cython getter, as CuPy's pool does. CuPy holds the GIL while it allocates, which the
getter and the hook's error path (PyErr_SetString) need.

A CuPy without that capsule (or with another signature) gets the Python route instead, with
one RuntimeWarning: cupy.cuda.memory.PythonFunctionAllocator, whose malloc reads
cupy.cuda.get_current_stream() in Python (a few microseconds per allocation and free).
install(compiled=False) asks for the Python route, install(compiled=True) fails without the
capsule. install(stream=s) fixes the stream instead (the compiled hook, no getter).

Blocks that live until the interpreter exits are given back by C code that calls no Python
(the compiled route), or by functions bound at install() that need nothing of a module being
torn down (the Python route): the exit is silent.
"""

import ctypes
import importlib
import re
import warnings

from . import _lib, _structs, host_free, host_malloc, malloc

_installed = None
_route = None
_warned = False

# CuPy's C getters of the current stream, in the order tried: cupy_backends' is the one
# cupy.cuda.stream's calls; both are `cdef intptr_t get_current_stream_ptr()` (CuPy 13, 14).
STREAM_GETTERS = (("cupy_backends.cuda.stream", "get_current_stream_ptr"),
                  ("cupy.cuda.stream", "get_current_stream_ptr"))
# The name Cython gives a cdef function's capsule: its C signature.
STREAM_GETTER_SIGNATURE = b"intptr_t (void)"


def _capsule_functions():
    """CPython's PyCapsule_GetName and PyCapsule_GetPointer, called with the GIL held; None
    where there is no CPython C API (ctypes.pythonapi)."""
    api = getattr(ctypes, "pythonapi", None)
    if api is None:
        return None
    return (ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", api)),
            ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", api)))


def _cupy():
    import cupy  # noqa: F401 (cupy.cuda.memory and pinned_memory load with it)

    return cupy


def _address(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def stream_getter():
    """(address, "module.name") of CuPy's C function `intptr_t get_current_stream_ptr(void)`,
    read from a Cython module's __pyx_capi__ capsule (STREAM_GETTERS, checked against
    STREAM_GETTER_SIGNATURE); (None, None) when no CuPy module exports it so, or without
    CPython's C API."""
    functions = _capsule_functions()
    if functions is None:
        return None, None
    capsule_name, capsule_pointer = functions
    for module, name in STREAM_GETTERS:
        try:
            capi = getattr(importlib.import_module(module), "__pyx_capi__", None) or {}
            capsule = capi.get(name)
            if capsule is None or capsule_name(capsule) != STREAM_GETTER_SIGNATURE:
                continue
            address = capsule_pointer(capsule, STREAM_GETTER_SIGNATURE)
        except Exception:  # noqa: BLE001 (no such module, or not a capsule: try the next)
            continue
        if address:
            return address, f"{module}.{name}"
    return None, None


_HOOK_MESSAGE = re.compile(r"(\S+) failed \(gpupool status (\d+)\): (.*)", re.S)


def _parts(text):
    """(call, status, message) of a message worded as gpupool.Error words it."""
    m = _HOOK_MESSAGE.fullmatch(text)
    if m:
        return m.group(1), int(m.group(2)), m.group(3)
    return "gpupool_cupy_hook_malloc", _lib.INTERNAL, text


class HookError(_lib.Error):
    """gpupool failed a CuPy allocation for another reason than memory (a bad device, a CUDA
    error, a capture): a gpupool.Error made from the one message the compiled hook raises it
    with ("gpupool_cupy_hook_malloc failed (gpupool status N): why")."""

    def __init__(self, text):
        super().__init__(*_parts(text))


_oom_types = {}


def out_of_memory_type(cupy=None):
    """The exception gpupool raises when a CuPy allocation finds no memory after gpupool's
    release-and-retry: a subclass of both cupy.cuda.memory.OutOfMemoryError (what CuPy's pool
    raises) and gpupool.OutOfMemoryError, made from one message (PyTorch's figures)."""
    base = (cupy or _cupy()).cuda.memory.OutOfMemoryError
    kind = _oom_types.get(base)
    if kind is None:
        class OutOfMemoryError(base, _lib.OutOfMemoryError):
            __doc__ = out_of_memory_type.__doc__

            def __init__(self, text):
                _lib.Error.__init__(self, *_parts(text))

        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        kind = _oom_types[base] = OutOfMemoryError
    return kind


def _python_route(cupy, lib):
    """PythonFunctionAllocator's malloc and free. Everything they call is bound here, so that a
    block CuPy frees while the interpreter tears gpupool's modules down (a cuFFT plan cache's
    work area, an array in a module's globals) still goes back silently: the free is the C
    function gpupool_cupy_free (a failure on stderr, never an exception)."""
    current = cupy.cuda.get_current_stream
    oom = out_of_memory_type(cupy)
    c_free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(("gpupool_cupy_free", lib))

    def malloc_(size, device_id):
        try:
            return malloc(size, device_id, current().ptr)
        except _lib.OutOfMemoryError as e:
            raise oom(str(e)) from None

    def free_(ptr, device_id):
        c_free(None, ptr, device_id)

    return malloc_, free_


class PinnedMemory:
    """Pinned host memory from gpupool's pinned cache, as cupy.cuda.PinnedMemory: `ptr` and
    `size`; given back to gpupool (gpupool_host_free) when CuPy drops it."""

    def __init__(self, size):
        self.size = size
        self.ptr = host_malloc(size) if size > 0 else 0

    def __int__(self):
        return self.ptr

    # host_free bound at definition: at interpreter exit the module's globals may be gone.
    def __del__(self, _host_free=host_free):
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                _host_free(ptr)
            except Exception:  # noqa: BLE001 (at interpreter exit the library may be gone)
                pass


def pinned_allocator(size):
    """The allocator for cupy.cuda.set_pinned_memory_allocator: a PinnedMemoryPointer over
    gpupool's pinned memory."""
    cupy = _cupy()
    return cupy.cuda.PinnedMemoryPointer(PinnedMemory(size), 0)


def _warn_once(message):
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def install(stream=None, pinned=True, compiled=None):
    """Makes gpupool CuPy's device allocator (and, with `pinned`, its pinned host allocator).
    Call before CuPy allocates: arrays made earlier keep CuPy's pool. Returns the allocator
    object handed to CuPy.

    `stream`: None to follow CuPy's current stream; a cupy Stream or a cudaStream_t value to
    allocate every block for that stream. `compiled`: None (the default) for the compiled hook
    when CuPy exports its stream getter (stream_getter()), else the Python route with one
    RuntimeWarning; True to require the hook (RuntimeError without the getter); False for the
    Python route. route() says which was taken. Out of memory raises out_of_memory_type(), a
    cupy.cuda.memory.OutOfMemoryError and a gpupool.OutOfMemoryError; another failure of the
    hook raises HookError (a gpupool.Error)."""
    cupy = _cupy()
    lib = _lib.lib()
    getter = None
    # A library older than the package (an older LD_PRELOAD shim's) may lack the hook.
    hook_malloc = getattr(lib, "gpupool_cupy_hook_malloc", None)
    hook_free = getattr(lib, "gpupool_cupy_hook_free", None)
    if stream is not None and hook_malloc is None:
        allocator = cupy.cuda.memory.CFunctionAllocator(
            _lib.stream_handle(stream), _address(lib.gpupool_cupy_malloc), _address(lib.gpupool_cupy_free), stream)
        return _set(cupy, allocator, "stream", pinned)
    if stream is None and compiled is not False:
        getter, _ = stream_getter() if hook_malloc is not None else (None, None)
        if getter is None:
            why = ("CuPy exports no C getter of its current stream (cupy_backends.cuda.stream."
                   "__pyx_capi__['get_current_stream_ptr'], signature 'intptr_t (void)')")
            if hook_malloc is None:
                why = f"the library {_lib.bound_path() or '(the process)'} has no gpupool_cupy_hook_malloc"
            if compiled:
                raise RuntimeError(f"gpupool.cupy.install(compiled=True): {why}")
            _warn_once(f"gpupool.cupy: {why}; each allocation calls Python instead, which is slower")
    if stream is None and getter is None:
        allocator = cupy.cuda.memory.PythonFunctionAllocator(*_python_route(cupy, lib))
        route = "python"
    else:
        hook = _structs.CupyHook()
        hook.current_stream = getter
        hook.stream = _lib.stream_handle(stream) if stream is not None else 0
        hook.err_occurred = _address(ctypes.pythonapi.PyErr_Occurred)
        hook.err_set_string = _address(ctypes.pythonapi.PyErr_SetString)
        oom = out_of_memory_type(cupy)
        hook.out_of_memory, hook.error = id(oom), id(HookError)
        # `owner` keeps the struct, the types it points to and the stream alive as long as
        # the allocator; the free function never reads `param`.
        owner = (hook, oom, HookError, stream)
        allocator = cupy.cuda.memory.CFunctionAllocator(
            ctypes.addressof(hook), _address(hook_malloc), _address(hook_free), owner)
        route = "hook" if stream is None else "stream"
    return _set(cupy, allocator, route, pinned)


def _set(cupy, allocator, route, pinned):
    global _installed, _route
    cupy.cuda.set_allocator(allocator.malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(pinned_allocator)
    _installed, _route = allocator, route
    return allocator


def route():
    """How install() reached gpupool: "hook" (the compiled hook on CuPy's current stream),
    "stream" (the compiled hook on the stream given), "python" (PythonFunctionAllocator), or
    None when gpupool is not CuPy's allocator."""
    return _route


def uninstall():
    """Gives CuPy back its own pools (cupy.get_default_memory_pool() and the pinned one).
    Arrays allocated through gpupool stay valid and go back to gpupool when freed."""
    global _installed, _route
    cupy = _cupy()
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    _installed = _route = None
