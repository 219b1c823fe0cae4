"""The C library behind the package: finding libgpupool.so, binding its functions with
ctypes, and turning a gpupool_status into an exception. Every other module of the package
calls gpupool through `lib()` and `check()` here, so that one process binds one library (one
allocator) whichever framework asks first."""

import ctypes
import ctypes.util
import numbers
import operator
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


# The ranges of the C types the package passes integers as (ctypes wraps a value outside them
# without a word: device=2**32+1 would reach gpupool as device 1).
INT_MIN, INT_MAX = -(1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)), (1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)) - 1
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
UINT64_MAX = (1 << 64) - 1


def integer(value, what, lo, hi):
    """`value` as an int of `lo` to `hi` (the range of the C type it is passed as), for every
    integer argument of the package: an int, an object with __index__ (a numpy integer), a
    ctypes integer or pointer (its .value), or a handle object with __int__ that is no number
    (cuda-bindings' CUstream and CUdeviceptr). Never a bool, a float, a str or None: TypeError
    naming `what`; ValueError naming it for a value out of range. Checked here, once, rather
    than left to ctypes, which wraps silently or raises its own ArgumentError."""
    if isinstance(value, bool) or isinstance(value, (float, str, bytes, type(None))):
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    if not isinstance(value, int):
        if isinstance(value, ctypes._SimpleCData) and isinstance(value.value, (int, type(None))) \
                and not isinstance(value.value, bool):
            value = value.value or 0  # a ctypes c_void_p, c_size_t, c_int
        elif hasattr(type(value), "__index__"):
            value = operator.index(value)  # numpy integers
        elif hasattr(type(value), "__int__") and not isinstance(value, numbers.Number):
            value = int(value)  # a handle object; not a Fraction or a Decimal, which would truncate
        else:
            raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{what}: {value} is out of range ({lo} to {hi})")
    return value


def unsigned(value, what):
    """`value` as an int of 0 to 2**64 - 1 (a pointer, a pool id, a stream handle); see integer()."""
    return integer(value, what, 0, UINT64_MAX)


def size(value, what):
    """`value` as a size_t (bytes, a count); see integer()."""
    return integer(value, what, 0, SIZE_MAX)


def device(value):
    """A device ordinal (-1: the current device) as a C int; see integer(). Whether the device
    exists is gpupool's to say (gpupool.Error, GPUPOOL_ERROR_INVALID_VALUE)."""
    return integer(value, "device", INT_MIN, INT_MAX)


def real(value, what):
    """`value` as a float for a C double: an int or a float (a numpy float), not a bool, a str
    or None (TypeError naming `what`). Its range is gpupool's to check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: expected a number, got {type(value).__name__}")
    return float(value)


def _no_nul(raw, what, value):
    if b"\0" in raw:
        # A C string ends at its first NUL: "/tmp/x\0.pickle" would write /tmp/x.
        raise ValueError(f"{what}: {value!r} holds a NUL character, which would cut it short")
    return raw


def text(value, what):
    """`value` (a str) as UTF-8 bytes for a C string: TypeError naming `what` for another type
    (bytes included: a name is text), ValueError for a NUL inside (C would see the text cut
    there) or a str that is not valid Unicode (a lone surrogate)."""
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a str, got {type(value).__name__}")
    try:
        raw = value.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: {value!r} cannot be encoded as UTF-8 ({e.reason})") from None
    return _no_nul(raw, what, value)


def path(value, what):
    """`value` (a str, bytes or os.PathLike) as the file system's bytes (os.fsencode) for a C
    string: TypeError naming `what` for another type, ValueError for a NUL inside."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"{what}: expected a path (str, bytes or os.PathLike), got {type(value).__name__}")
    return _no_nul(os.fsencode(value), what, value)


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
        "gpupool_stream_retire": [_INT, _P, ctypes.POINTER(_INT)],
        "gpupool_empty_cache": [_INT],
        "gpupool_device_count": [ctypes.POINTER(_INT)],
        "gpupool_set_memory_fraction": [ctypes.c_double, _INT],
        "gpupool_largest_allocatable": [_INT, _P, ctypes.POINTER(_SZ)],
        "gpupool_enable_peer_access": [_INT, _INT],
        "gpupool_segment_mapped_range": [_P, ctypes.POINTER(s.MappedRange), ctypes.POINTER(_INT)],
        "gpupool_stats": [_INT, ctypes.POINTER(s.Stats)],
        "gpupool_pool_stats": [_INT, ctypes.c_uint64, ctypes.POINTER(s.Stats)],
        "gpupool_reset_peak_stats": [_INT],
        "gpupool_memory_summary": [_INT, ctypes.c_char_p, _SZ, ctypes.POINTER(_SZ)],
        "gpupool_set_config": [ctypes.c_char_p],
        "gpupool_config_string": [ctypes.c_char_p, _SZ, ctypes.POINTER(_SZ)],
        "gpupool_record_history": [_INT, _SZ, ctypes.c_uint32],
        "gpupool_dump_snapshot": [ctypes.c_char_p],
        "gpupool_dump_snapshot_with": [ctypes.c_char_p, _INT],
        "gpupool_set_memory_metadata": [ctypes.c_char_p],
        "gpupool_get_memory_metadata": [ctypes.c_char_p, _SZ, ctypes.POINTER(_SZ)],
        "gpupool_annotate_memory": [_P, ctypes.c_char_p],
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
        "gpupool_pool_create_ex": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint32],
        "gpupool_begin_allocate_to_pool_thread": [_INT, ctypes.c_uint64],
        "gpupool_end_allocate_to_pool": [_INT, ctypes.c_uint64],
        "gpupool_release_pool": [_INT, ctypes.c_uint64],
        "gpupool_pool_set_limit": [_INT, ctypes.c_uint64, ctypes.c_uint64],
        "gpupool_pool_get_limit": [_INT, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)],
        "gpupool_sleep": [_INT, ctypes.c_uint64, ctypes.c_uint32],
        "gpupool_wake": [_INT, ctypes.c_uint64],
        "gpupool_sleep_host_bytes": [_INT, ctypes.POINTER(_SZ), ctypes.POINTER(_SZ)],
        "gpupool_sleep_release_kept": [_INT, ctypes.c_uint64, ctypes.POINTER(_SZ)],
        "gpupool_sleep_prepare": [_INT, ctypes.c_uint64, ctypes.c_uint32, ctypes.POINTER(_SZ)],
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
