"""The C structs and callback types of gpupool.h, field for field, and their flat dicts."""

import ctypes

ARRAYS = [
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
]
COUNTERS = [
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
    "max_split_size",
]
_FIELDS = ("current", "peak", "allocated", "freed")


class Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in _FIELDS]


class StatArray(ctypes.Structure):
    _fields_ = [(n, Stat) for n in ("all", "small_pool", "large_pool")]


class Stats(ctypes.Structure):
    """gpupool_stats_t (include/gpupool.h), version 4."""

    _fields_ = (
        [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)]
        + [(n, StatArray) for n in ARRAYS]
        + [("oversize_allocations", Stat), ("oversize_segments", Stat)]
        + [(n, ctypes.c_int64) for n in COUNTERS]
        # Version 2: held physical pages of expandable segments (not in PyTorch).
        + [("unmapped_held_bytes", Stat)]
        # Version 3: bytes of pages sleeping pools gave back (gpupool_sleep; not in PyTorch).
        + [("sleeping_bytes", Stat)]
        # Version 4: the pool's limit (gpupool_pool_set_limit), INT64_MAX for none.
        + [("pool_limit", ctypes.c_int64)]
    )


class DurationStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("count", "total", "max", "min")]


class HostStats(ctypes.Structure):
    """gpupool_host_stats_t (include/gpupool.h), version 1."""

    _fields_ = (
        [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)]
        + [(n, Stat) for n in ("active_requests", "active_bytes", "allocations", "allocated_bytes")]
        + [(n, DurationStat) for n in ("host_alloc_time", "host_free_time")]
        + [(n, ctypes.c_int64) for n in ("num_host_alloc", "num_host_free")]
    )


class TagStats(ctypes.Structure):
    """gpupool_tag_stats_t."""

    _fields_ = [("bytes", Stat), ("blocks", Stat)]


TAG_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.POINTER(TagStats), ctypes.c_void_p)
OUTPUT_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_void_p)


def sized(cls):
    """A zeroed struct of `cls` whose `size` field says how large it is."""
    s = cls()
    s.size = ctypes.sizeof(cls)
    return s


def flat_stats(s):
    """A gpupool_stats_t as torch.cuda.memory_stats() keys it: 'reserved_bytes.all.peak', ..."""
    out = {}
    for name in ARRAYS:
        arr = getattr(s, name)
        for pool in ("all", "small_pool", "large_pool"):
            for field in _FIELDS:
                out[f"{name}.{pool}.{field}"] = getattr(getattr(arr, pool), field)
    for name in ("oversize_allocations", "oversize_segments", "unmapped_held_bytes", "sleeping_bytes"):
        for field in _FIELDS:
            out[f"{name}.{field}"] = getattr(getattr(s, name), field)
    for name in COUNTERS + ["pool_limit"]:
        out[name] = getattr(s, name)
    return out


def flat_host_stats(s):
    """A gpupool_host_stats_t as torch.cuda.host_memory_stats() keys it."""
    out = {}
    for name in ("active_requests", "active_bytes", "allocations", "allocated_bytes"):
        for field in _FIELDS:
            out[f"{name}.{field}"] = getattr(getattr(s, name), field)
    for name in ("host_alloc_time", "host_free_time"):
        for field in ("count", "total", "max", "min"):
            out[f"{name}.{field}"] = getattr(getattr(s, name), field)
    out["num_host_alloc"] = s.num_host_alloc
    out["num_host_free"] = s.num_host_free
    return out


def flat_tag(s):
    """A gpupool_tag_stats_t as {'bytes.current': ..., 'blocks.peak': ...}."""
    return {f"{n}.{f}": getattr(getattr(s, n), f) for n in ("bytes", "blocks") for f in _FIELDS}


class CupyHook(ctypes.Structure):
    """gpupool_cupy_hook_t (include/gpupool_plugins.h): the `param` of gpupool_cupy_hook_malloc,
    CuPy's CFunctionAllocator malloc. Addresses: CuPy's C getter of its current stream (or 0,
    `stream` then), CPython's PyErr_Occurred and PyErr_SetString, and the two exception types
    (borrowed PyObject pointers: the allocator's owner keeps them alive)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "current_stream", "stream", "err_occurred", "err_set_string", "out_of_memory", "error")]


class MappedRange(ctypes.Structure):
    """gpupool_mapped_range_t: what a transport registers for a pointer
    (gpupool_segment_mapped_range, docs/transports.md)."""

    _fields_ = (
        ("address", ctypes.c_void_p),
        ("bytes", ctypes.c_size_t),
        ("segment_address", ctypes.c_void_p),
        ("segment_bytes", ctypes.c_size_t),
        ("device", ctypes.c_int),
        ("expandable", ctypes.c_int),
        ("stream", ctypes.c_void_p),
        ("pool", ctypes.c_uint64),
    )
