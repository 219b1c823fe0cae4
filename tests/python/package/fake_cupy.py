"""A stand-in for the cupy names gpupool.cupy uses, behaving as CuPy 14 does, for the tests
without a GPU (test_cupy.py, and the interpreter-exit programs it runs).

- cupy.cuda: set_allocator, set_pinned_memory_allocator, get_current_stream, PinnedMemoryPointer,
  memory.PythonFunctionAllocator, memory.CFunctionAllocator, memory.OutOfMemoryError.
- CFunctionAllocator calls the C functions through their addresses with CuPy's signatures,
  holding the GIL (ctypes.PYFUNCTYPE), and raises an exception the malloc left pending, as
  CuPy's `_call_malloc` (`except? -1`) does; a NULL result is kept as pointer 0, as CuPy does.
- cupy_backends.cuda.stream.__pyx_capi__: with `capsule=True`, the capsule Cython writes for
  `cdef intptr_t get_current_stream_ptr()` (named "intptr_t (void)"), around a function that
  returns the stand-in's current stream.
"""

import ctypes
import types

_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
GETTER = ctypes.CFUNCTYPE(ctypes.c_ssize_t)


def capsule(address, name):
    """A PyCapsule of `address` named `name` (a bytes object the caller keeps alive: the
    capsule keeps only its pointer)."""
    return _new_capsule(address, name, None)


def make(current_stream, capsule_name=b"intptr_t (void)", getter_address=None):
    """(cupy, backends, state): the stand-in `cupy` module, its `cupy_backends.cuda.stream`
    (None for `capsule_name` None: no capsule) and the dict its calls write to (`allocator`,
    `pinned`, `stream`: set `stream` to change CuPy's current stream). `getter_address`: the
    C function the capsule holds instead of the stand-in's getter."""
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

        def malloc(self, size, device=0):
            ptr = self._malloc(size, device)
            free = self._free
            return Memory(ptr, size, lambda p: free(p, device))

    class CFunctionAllocator:
        malloc_type = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        free_type = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)

        def __init__(self, param, malloc_func, free_func, owner):
            self._param, self._owner = param, owner
            self.malloc_address, self.free_address = malloc_func, free_func
            self._malloc = self.malloc_type(malloc_func)
            self._free = self.free_type(free_func)

        def malloc(self, size, device=0):
            ptr = self._malloc(self._param, size, device) or 0
            free, param = self._free, self._param
            return Memory(ptr, size, lambda p: free(param, p, device))

    class PinnedMemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(
        set_allocator=lambda a: state.__setitem__("allocator", a),
        set_pinned_memory_allocator=lambda a: state.__setitem__("pinned", a),
        get_current_stream=lambda: types.SimpleNamespace(ptr=state["stream"]),
        PinnedMemoryPointer=PinnedMemoryPointer,
        memory=types.SimpleNamespace(PythonFunctionAllocator=PythonFunctionAllocator,
                                     CFunctionAllocator=CFunctionAllocator,
                                     OutOfMemoryError=OutOfMemoryError),
    )
    cupy.get_default_memory_pool = lambda: types.SimpleNamespace(malloc="cupy's pool")
    cupy.get_default_pinned_memory_pool = lambda: types.SimpleNamespace(malloc="cupy's pinned pool")

    backends = types.ModuleType("cupy_backends.cuda.stream")
    backends.__pyx_capi__ = {}
    if capsule_name is not None:
        getter = GETTER(lambda: state["stream"])
        address = getter_address or ctypes.cast(getter, ctypes.c_void_p).value
        # The capsule, its name and the getter live as long as the module.
        backends._keep = (getter, capsule_name)
        backends.__pyx_capi__["get_current_stream_ptr"] = capsule(address, capsule_name)
    return cupy, backends, state


def install_modules(modules, cupy, backends):
    """Puts the stand-ins in `modules` (sys.modules, or pytest's monkeypatch.setitem wrapper):
    `cupy`, and `cupy_backends.cuda.stream` and `cupy.cuda.stream` (which CuPy also exports
    the getter from) as `backends`."""
    modules("cupy", cupy)
    modules("cupy_backends.cuda.stream", backends)
    modules("cupy.cuda.stream", backends)
