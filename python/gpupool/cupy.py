"""gpupool as CuPy's allocator (docs/cupy.md).

    import cupy, gpupool
    gpupool.cupy.install()           # device memory on CuPy's current stream, and pinned memory
    ...
    gpupool.stats()                  # CuPy's blocks, with PyTorch's and the rest of the process's

install() calls cupy.cuda.set_allocator and cupy.cuda.set_pinned_memory_allocator. By default
each allocation is made for CuPy's current stream (cupy.cuda.get_current_stream()), as CuPy's
own MemoryPool keeps a free list per stream: a block freed by work on one stream is reused on
that stream only (gpupool_record_stream extends that). CuPy's CFunctionAllocator has no
stream argument, and CuPy's current stream can be read from Python only, so this default goes
through cupy.cuda.memory.PythonFunctionAllocator (about 3 microseconds of Python per
allocation and free; docs/cupy.md). install(stream=s) fixes the stream instead and hands CuPy gpupool's C functions
through CFunctionAllocator (gpupool_cupy_malloc and gpupool_cupy_free, the stream as
`param`): no Python per allocation, for programs that run CuPy on one stream.
"""

import ctypes

from . import _lib, free, host_free, host_malloc, malloc

_installed = None


def _cupy():
    import cupy  # noqa: F401 (cupy.cuda.memory and pinned_memory load with it)

    return cupy


def _malloc(size, device_id):
    """PythonFunctionAllocator's malloc: `size` bytes on `device_id` for CuPy's current
    stream; raises cupy.cuda.memory.OutOfMemoryError (CuPy's own type) when gpupool is out of
    memory."""
    cupy = _cupy()
    stream = cupy.cuda.get_current_stream().ptr
    try:
        return malloc(size, device_id, stream)
    except _lib.OutOfMemoryError as e:
        raise cupy.cuda.memory.OutOfMemoryError(size, -1) from e


def _free(ptr, device_id):
    """PythonFunctionAllocator's free: gpupool_free (gpupool knows the block's device)."""
    free(ptr)


class PinnedMemory:
    """Pinned host memory from gpupool's pinned cache, as cupy.cuda.PinnedMemory: `ptr` and
    `size`; given back to gpupool (gpupool_host_free) when CuPy drops it."""

    def __init__(self, size):
        self.size = size
        self.ptr = host_malloc(size) if size > 0 else 0

    def __int__(self):
        return self.ptr

    def __del__(self):
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                host_free(ptr)
            except Exception:  # noqa: BLE001 (at interpreter exit the library may be gone)
                pass


def pinned_allocator(size):
    """The allocator for cupy.cuda.set_pinned_memory_allocator: a PinnedMemoryPointer over
    gpupool's pinned memory."""
    cupy = _cupy()
    return cupy.cuda.PinnedMemoryPointer(PinnedMemory(size), 0)


def install(stream=None, pinned=True):
    """Makes gpupool CuPy's device allocator (and, with `pinned`, its pinned host allocator).
    `stream`: None to follow CuPy's current stream (PythonFunctionAllocator); a cupy Stream or
    a cudaStream_t value to allocate every block for that stream through gpupool's C functions
    (CFunctionAllocator). Call before CuPy allocates: arrays made earlier keep CuPy's pool.
    Returns the allocator object handed to CuPy."""
    global _installed
    cupy = _cupy()
    lib = _lib.lib()
    if stream is None:
        allocator = cupy.cuda.memory.PythonFunctionAllocator(_malloc, _free)
    else:
        handle = _lib.stream_handle(stream)
        address = ctypes.cast(lib.gpupool_cupy_malloc, ctypes.c_void_p).value
        free_address = ctypes.cast(lib.gpupool_cupy_free, ctypes.c_void_p).value
        # `owner` keeps the stream object alive as long as the allocator.
        allocator = cupy.cuda.memory.CFunctionAllocator(handle, address, free_address, stream)
    cupy.cuda.set_allocator(allocator.malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(pinned_allocator)
    _installed = allocator
    return allocator


def uninstall():
    """Gives CuPy back its own pools (cupy.get_default_memory_pool() and the pinned one).
    Arrays allocated through gpupool stay valid and go back to gpupool when freed."""
    global _installed
    cupy = _cupy()
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
    _installed = None
