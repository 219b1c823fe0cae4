"""The C library behind the package: finding libgpupool.so, binding its functions with
ctypes, and turning a gpupool_status into an exception. Every other module of the package
calls gpupool through `lib()` and `check()` here, so that one process binds one library (one
allocator) whichever framework asks first."""

import ctypes
import ctypes.util
import os
import pathlib
import threading

# gpupool_status of gpupool.h, by value.
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, INVALID_POINTER, DRIVER_UNAVAILABLE, CUDA, INTERNAL, STREAM_CAPTURE = range(8)


class Error(RuntimeError):
    """A gpupool call failed: `status` is the gpupool_status (an int), `message` gpupool's own
    text, which starts with the C function's name."""

    def __init__(self, call, status, message):
        self.call, self.status, self.message = call, status, message
        super().__init__(f"{call} failed (gpupool status {status}): {message}")


class OutOfMemoryError(Error, MemoryError):
    """gpupool_malloc or gpupool_host_malloc ran out of memory after release-and-retry; the
    message has PyTorch's figures (requested, total, free, allocated, reserved)."""


_lock = threading.Lock()
_lib = None
_path = None


def _candidates():
    """The libraries to try when none is bound, in order (see find_library)."""
    here = pathlib.Path(__file__).resolve().parent
    # A wheel or `pip install .`: the library sits inside the package.
    yield here / "libgpupool.so"
    # The repository's builds (python/gpupool/ is two folders down), then an installed prefix
    # (<prefix>/share/gpupool/python/gpupool/).
    parents = here.parents
    root = parents[1]
    for rel in ("build/cargo/release", "target/release", ".device/prefix/lib"):
        yield root / rel / "libgpupool.so"
    if len(parents) > 3:
        prefix = parents[3]
        yield from sorted(prefix.glob("lib*/libgpupool.so"))
        yield from sorted(prefix.glob("lib*/*/libgpupool.so"))


def find_library():
    """The path of the libgpupool.so this package loads: $GPUPOOL_LIB, else the one inside the
    package (a wheel), else the repository's build or the installed prefix the package sits in,
    else the system's (ctypes.util.find_library). Raises FileNotFoundError when none exists."""
    if os.environ.get("GPUPOOL_LIB"):
        return os.environ["GPUPOOL_LIB"]
    for candidate in _candidates():
        if candidate.exists():
            return str(candidate)
    found = ctypes.util.find_library("gpupool")
    if found:
        return found
    raise FileNotFoundError("libgpupool.so not found: install the gpupool package (pip install .) or set GPUPOOL_LIB")


def _process_gpupool():
    """The gpupool already in the process's global scope (the LD_PRELOAD shim exports the
    gpupool_* functions), or None."""
    process = ctypes.CDLL(None)
    if hasattr(process, "gpupool_stats") and hasattr(process, "gpupool_last_error_message"):
        return process
    return None


def bind(path=None):
    """Binds the package to one gpupool and returns it (a ctypes.CDLL): `path` when given, else
    the gpupool the process already has (the LD_PRELOAD shim's), else find_library(). Binding
    again with nothing or the same path returns the same library; binding another path once
    one is bound raises RuntimeError, since two libraries would be two allocators."""
    global _lib, _path
    with _lock:
        if path is not None:
            path = os.fspath(path)
            if os.sep in path and not os.path.exists(path):
                raise FileNotFoundError(f"{path}: no such library")
            if _lib is not None and _path != path and os.path.realpath(_path or "") != os.path.realpath(path):
                raise RuntimeError(f"gpupool is already bound to {_path or 'the process (LD_PRELOAD)'}; "
                                   f"cannot bind {path} too (two libraries would be two allocators)")
        if _lib is not None:
            return _lib
        if path is None:
            lib = _process_gpupool()
            where = None
            if lib is None:
                where = find_library()
                lib = ctypes.CDLL(where)
        else:
            lib = ctypes.CDLL(path)
            where = path
        _declare(lib)
        _lib, _path = lib, where
        return lib


def bound_path():
    """The path of the bound library; None when none is bound or it is the process's own."""
    return _path


def lib():
    """The bound library, binding one first (bind()) when none is."""
    return _lib if _lib is not None else bind()


def check(status, call):
    """Raises the Error (OutOfMemoryError for GPUPOOL_ERROR_OUT_OF_MEMORY) of a failed call."""
    if status != SUCCESS:
        message = _lib.gpupool_last_error_message().decode("utf-8", "replace")
        raise (OutOfMemoryError if status == OUT_OF_MEMORY else Error)(call, status, message)


def unsigned(value, what):
    """`value` as an int of 0 to 2**64 - 1 (a size, a pointer, a count, a stream handle): an
    int, a ctypes value, or an object with __int__ (not a float or a bool); TypeError or
    ValueError naming `what` otherwise, rather than ctypes' silent wrap to 64 bits."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    if not isinstance(value, int):
        if isinstance(getattr(value, "value", 0.5), (int, type(None))):
            value = value.value or 0  # a ctypes c_void_p or c_size_t
        elif hasattr(value, "__int__"):
            value = int(value)  # cuda-bindings' CUstream and CUdeviceptr, numpy integers
        else:
            raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 64:
        raise ValueError(f"{what}: {value} is not in 0 .. 2**64 - 1")
    return value


def text(value, what):
    """`value` (a str) as UTF-8 bytes for a C string; TypeError naming `what` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a str, got {type(value).__name__}")
    return value.encode()


def stream_handle(stream):
    """A stream argument as a cudaStream_t value: None or 0 (the legacy default stream), an int,
    or any object with a `ptr` (CuPy), `cuda_stream` (PyTorch) or `handle` (Numba) attribute."""
    if stream is None:
        return 0
    for attr in ("ptr", "cuda_stream", "handle"):
        if hasattr(stream, attr):
            stream = getattr(stream, attr)
            break
    return unsigned(stream, "stream")


_P = ctypes.c_void_p
_SZ = ctypes.c_size_t
_INT = ctypes.c_int


def _declare(lib):
    """The argument and result types of every function the package calls."""
    from . import _structs as s

    sigs = {
        "gpupool_malloc": [ctypes.POINTER(_P), _SZ, _INT, _P],
        "gpupool_free": [_P],
        "gpupool_record_stream": [_P, _P],
        "gpupool_empty_cache": [_INT],
        "gpupool_device_count": [ctypes.POINTER(_INT)],
        "gpupool_set_memory_fraction": [ctypes.c_double, _INT],
        "gpupool_largest_allocatable": [_INT, _P, ctypes.POINTER(_SZ)],
        "gpupool_stats": [_INT, ctypes.POINTER(s.Stats)],
        "gpupool_pool_stats": [_INT, ctypes.c_uint64, ctypes.POINTER(s.Stats)],
        "gpupool_reset_peak_stats": [_INT],
        "gpupool_memory_summary": [_INT, ctypes.c_char_p, _SZ, ctypes.POINTER(_SZ)],
        "gpupool_set_config": [ctypes.c_char_p],
        "gpupool_config_string": [ctypes.c_char_p, _SZ, ctypes.POINTER(_SZ)],
        "gpupool_record_history": [_INT, _SZ, ctypes.c_uint32],
        "gpupool_dump_snapshot": [ctypes.c_char_p],
        "gpupool_push_tag": [ctypes.c_char_p],
        "gpupool_pop_tag": [],
        "gpupool_tag_stats": [ctypes.c_char_p, ctypes.POINTER(s.TagStats)],
        "gpupool_for_each_tag": [s.TAG_FN, _P],
        "gpupool_live_report": [_INT, s.OUTPUT_FN, _P],
        "gpupool_host_malloc": [ctypes.POINTER(_P), _SZ],
        "gpupool_host_free": [_P],
        "gpupool_host_record_event": [_P, _P],
        "gpupool_host_empty_cache": [],
        "gpupool_host_stats": [ctypes.POINTER(s.HostStats)],
        "gpupool_host_reset_peak_stats": [],
        "gpupool_pool_create": [ctypes.POINTER(ctypes.c_uint64)],
        "gpupool_pool_create_sleepable": [ctypes.POINTER(ctypes.c_uint64)],
        "gpupool_begin_allocate_to_pool_thread": [_INT, ctypes.c_uint64],
        "gpupool_end_allocate_to_pool": [_INT, ctypes.c_uint64],
        "gpupool_release_pool": [_INT, ctypes.c_uint64],
        "gpupool_sleep": [_INT, ctypes.c_uint64, ctypes.c_uint32],
        "gpupool_wake": [_INT, ctypes.c_uint64],
        "gpupool_sleep_host_bytes": [_INT, ctypes.POINTER(_SZ), ctypes.POINTER(_SZ)],
        "gpupool_sleep_release_kept": [_INT, ctypes.c_uint64, ctypes.POINTER(_SZ)],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_uint32
    for name in ("gpupool_last_error_message", "gpupool_version"):
        getattr(lib, name).restype = ctypes.c_char_p
        getattr(lib, name).argtypes = []
    lib.gpupool_status_string.restype = ctypes.c_char_p
    lib.gpupool_status_string.argtypes = [ctypes.c_uint32]
