"""gpupool as Numba's CUDA memory manager: an External Memory Management (EMM) plugin
(docs/numba.md).

    NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba python program.py

or, before Numba's CUDA context starts, `numba.cuda.set_memory_manager(gpupool.numba.
GpupoolNumbaManager)`. Device arrays (cuda.device_array, cuda.to_device, ...) then come from
gpupool's cache, and plain pinned host buffers (cuda.pinned_array) from gpupool's pinned cache.

What differs from Numba's own manager: Numba's memalloc has no stream argument, so every block
is allocated for the default stream (the per-thread default stream under
NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1), and is back in gpupool's cache as soon as Numba drops
its last reference (Numba defers its own cuMemFree). Work queued on another stream that still
uses an array must be done, or the block recorded with gpupool.record_stream(ptr, stream),
before the array is dropped; RMM's Numba plugin has the same rule. Inside
cuda.defer_cleanup() nothing is given back until the outermost block ends. Mapped,
write-combined and pinned-in-place (mempin) host memory stay Numba's: gpupool's pinned cache
hands out its own buffers and cannot pin memory the caller owns. IPC handles
(get_ipc_handle) need ordinary segments: GPUPOOL_CONF=expandable_segments:False.
"""

import contextlib
import ctypes
import threading

from numba import cuda as _cuda
from numba.cuda.cudadrv import driver as _driver

from . import _lib, empty_cache, free, host_free, host_malloc, malloc

# cudaStreamPerThread, the per-thread default stream's handle.
_PER_THREAD_STREAM = 2


try:  # numba-cuda
    from numba.cuda.core import config as _config
except ImportError:  # the numba.cuda of Numba itself, before numba-cuda
    from numba.core import config as _config


def _default_stream():
    """The stream Numba's work goes to without one: the legacy default stream, or the
    per-thread default stream under NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1."""
    return _PER_THREAD_STREAM if getattr(_config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0) else 0


class GpupoolNumbaManager(_cuda.GetIpcHandleMixin, _cuda.HostOnlyCUDAMemoryManager):
    """Numba's EMM plugin on gpupool: memalloc through gpupool_malloc, memhostalloc (plain
    pinned) through gpupool_host_malloc; mempin, mapped and write-combined host memory through
    Numba's own HostOnlyCUDAMemoryManager."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._defer_depth = 0
        self._deferred = []

    @property
    def interface_version(self):
        return 1

    def initialize(self):
        """Binds libgpupool.so (gpupool.bind()), so that a missing library fails when Numba's
        context starts rather than at the first array."""
        _lib.lib()

    def _device(self):
        device = getattr(self.context, "device", None)
        return getattr(device, "id", -1)

    def memalloc(self, size):
        """`size` bytes of device memory from gpupool for the default stream, owned by the
        returned MemoryPointer: freed to gpupool's cache when Numba drops it. Raises
        gpupool.OutOfMemoryError (a MemoryError) when gpupool is out of memory after its
        release-and-retry."""
        # At least one byte: Numba asks for 0 for empty arrays and needs a pointer all the same.
        ptr = malloc(max(size, 1), self._device(), _default_stream())
        return _cuda.MemoryPointer(self.context, ctypes.c_void_p(ptr), size, finalizer=self._finalizer(ptr))

    def _finalizer(self, ptr):
        # free bound here: a block Numba frees while the interpreter exits finds the module's
        # globals gone.
        def release(free=free):
            with self._lock:
                if self._defer_depth:
                    self._deferred.append(ptr)
                    return
            free(ptr)

        return release

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        """Pinned host memory: plain requests from gpupool's pinned cache, freed to it when
        Numba drops the buffer; mapped or write-combined requests from Numba's own allocator
        (cuMemHostAlloc with those flags). `portable` is what gpupool's pinned memory is."""
        if mapped or wc:
            return super().memhostalloc(size, mapped=mapped, portable=portable, wc=wc)
        ptr = host_malloc(max(size, 1))

        def release(host_free=host_free):
            host_free(ptr)

        return _driver.PinnedMemory(self.context, ptr, size, finalizer=release)

    def get_memory_info(self):
        """(free, total) bytes of the device as the driver sees them (cuMemGetInfo): gpupool's
        cached blocks count as used."""
        free_bytes, total = _driver.driver.cuMemGetInfo()
        return _cuda.MemoryInfo(free=free_bytes, total=total)

    def reset(self):
        """Numba's context reset: gpupool's cached free segments of this device go back to the
        driver (gpupool_empty_cache); live arrays stay valid. Host memory as Numba's own."""
        super().reset()
        empty_cache(self._device())

    @contextlib.contextmanager
    def defer_cleanup(self):
        """While active, device blocks Numba drops are kept out of the cache; the outermost
        block's end gives them back."""
        with self._lock:
            self._defer_depth += 1
        try:
            with super().defer_cleanup():
                yield
        finally:
            with self._lock:
                self._defer_depth -= 1
                ready = self._deferred if self._defer_depth == 0 else []
                if ready:
                    self._deferred = []
            for ptr in ready:
                free(ptr)


# The name Numba looks up in the module NUMBA_CUDA_MEMORY_MANAGER names.
_numba_memory_manager = GpupoolNumbaManager
