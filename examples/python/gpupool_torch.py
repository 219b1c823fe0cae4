"""gpupool under PyTorch, through PyTorch's pluggable-allocator interface.

    import torch, gpupool_torch
    gpupool_torch.install()          # before the first CUDA tensor
    ...
    print(gpupool_torch.summary())   # torch.cuda.memory_summary() is the native allocator's

install() loads libgpupool.so (the path given, else $GPUPOOL_LIB, else the library the
repository's build or an installed prefix holds), makes it PyTorch's CUDA allocator with
torch.cuda.memory.CUDAPluggableAllocator and change_current_allocator, and wires the optional
hooks: init, reset (torch.cuda.empty_cache), memory fraction
(torch.cuda.set_per_process_memory_fraction) and record_stream (Tensor.record_stream).

CUDA graphs: when libgpupool_torch_graphs.so (built from gpupool_torch_graphs.cpp, installed
beside libgpupool.so) is found, install() also wires PyTorch's private-pool hooks, so that
torch.cuda.graph captures into a gpupool private pool and its memory goes back when the graphs
are reset. torch.cuda.graph leaks the pool of a capture that fails; capture it through
gpupool_torch.graph(g) instead, which releases it (and re-raises).

With the pluggable allocator installed, torch.cuda.memory_stats() and friends do not report
gpupool's figures; stats() and summary() here do, from gpupool_stats and
gpupool_memory_summary. Likewise torch.cuda.memory._record_memory_history() and
_dump_snapshot() see nothing of gpupool's: record_history() and dump_snapshot() here are
theirs, from gpupool_record_history and gpupool_dump_snapshot, and write the same file for
the same viewer (python3 -m torch.cuda._memory_viz trace_plot FILE -o FILE.html).
"""

import contextlib
import ctypes
import ctypes.util
import os
import pathlib

_lib = None

_ARRAYS = [
    "allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
    "active_bytes", "inactive_split_bytes", "requested_bytes",
]
_COUNTERS = [
    "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
    "max_split_size",
]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("current", "peak", "allocated", "freed")]


class _StatArray(ctypes.Structure):
    _fields_ = [(n, _Stat) for n in ("all", "small_pool", "large_pool")]


class _Stats(ctypes.Structure):
    """gpupool_stats_t, field for field (include/gpupool.h)."""

    _fields_ = (
        [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)]
        + [(n, _StatArray) for n in _ARRAYS]
        + [("oversize_allocations", _Stat), ("oversize_segments", _Stat)]
        + [(n, ctypes.c_int64) for n in _COUNTERS]
        # Version 2 of the struct: held physical pages of expandable segments (not in PyTorch).
        + [("unmapped_held_bytes", _Stat)]
        # Version 3: bytes of pages sleeping pools gave back (gpupool_sleep; not in PyTorch).
        + [("sleeping_bytes", _Stat)]
    )


def find_library():
    """The libgpupool.so to use: $GPUPOOL_LIB, else the repository's build, else the system's."""
    if os.environ.get("GPUPOOL_LIB"):
        return os.environ["GPUPOOL_LIB"]
    here = pathlib.Path(__file__).resolve()
    # The repository's builds (examples/python/ is two folders down), then an installed prefix
    # (this file installed as <prefix>/share/gpupool/python/gpupool_torch.py).
    root, prefix = here.parents[2], here.parents[3] if len(here.parents) > 3 else here.parents[-1]
    candidates = [root / "build/cargo/release/libgpupool.so", root / "target/release/libgpupool.so",
                  root / ".device/prefix/lib/libgpupool.so"]
    candidates += sorted(prefix.glob("lib*/libgpupool.so")) + sorted(prefix.glob("lib*/*/libgpupool.so"))
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    found = ctypes.util.find_library("gpupool")
    if found:
        return found
    raise FileNotFoundError("libgpupool.so not found: pass its path or set GPUPOOL_LIB")


def _bound():
    """The bound library, or a RuntimeError that says how to bind one."""
    if _lib is None:
        raise RuntimeError("gpupool is not bound in this process: call gpupool_torch.install() "
                           "(gpupool as PyTorch's allocator) or gpupool_torch.attach() (a gpupool "
                           "already loaded, e.g. by the LD_PRELOAD shim) first")
    return _lib


def _check(status, call):
    if status != 0:
        msg = _lib.gpupool_last_error_message().decode()
        raise RuntimeError(f"{call} failed (gpupool status {status}): {msg}")


def _bind(lib):
    lib.gpupool_last_error_message.restype = ctypes.c_char_p
    lib.gpupool_pool_stats.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(_Stats)]
    lib.gpupool_stats.argtypes = [ctypes.c_int, ctypes.POINTER(_Stats)]
    lib.gpupool_reset_peak_stats.argtypes = [ctypes.c_int]
    lib.gpupool_memory_summary.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                           ctypes.POINTER(ctypes.c_size_t)]
    lib.gpupool_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_uint32]
    lib.gpupool_dump_snapshot.argtypes = [ctypes.c_char_p]
    return lib


def install(path=None):
    """Makes gpupool PyTorch's CUDA allocator. Call before anything allocates CUDA memory."""
    global _lib
    import torch

    path = path or find_library()
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "gpupool_torch_malloc", "gpupool_torch_free")
    # The same library PyTorch just opened (dlopen of one path gives one handle, one allocator).
    _lib = _bind(ctypes.CDLL(path))
    native = allocator.allocator()
    hooks = [
        ("set_init_fn", "gpupool_torch_init"),
        ("set_reset_fn", "gpupool_torch_empty_cache"),
        ("set_memory_fraction_fn", "gpupool_torch_set_memory_fraction"),
        ("set_record_stream_fn", "gpupool_torch_record_stream"),
    ]
    for setter, symbol in hooks:
        getattr(native, setter)(ctypes.cast(getattr(_lib, symbol), ctypes.c_void_p).value)
    global _graphs
    graphs_path = os.path.join(os.path.dirname(path), "libgpupool_torch_graphs.so")
    if os.path.exists(graphs_path):
        _graphs = ctypes.CDLL(graphs_path)
        _graphs.gpupool_torch_watch_captures.argtypes = [ctypes.c_int]
        _graphs.gpupool_torch_end_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _graphs.gpupool_torch_pool_id.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
        _graphs.gpupool_torch_pool_id.restype = ctypes.c_uint64
        for setter, symbol in [
            ("set_begin_allocate_to_pool", "gpupool_torch_begin_allocate_to_pool"),
            ("set_end_allocate_to_pool_fn", "gpupool_torch_end_allocate_to_pool"),
            ("set_release_pool", "gpupool_torch_release_pool"),
        ]:
            getattr(native, setter)(ctypes.cast(getattr(_graphs, symbol), ctypes.c_void_p).value)
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator


_graphs = None
# How many pools graph() released when its last failed capture raised.
released_by_failed_capture = 0


@contextlib.contextmanager
def graph(cuda_graph, **kwargs):
    """torch.cuda.graph(cuda_graph, **kwargs), which also releases the graph's private pool when
    the capture fails (torch.cuda.graph leaves it routed and allocated until the process ends),
    then re-raises."""
    import torch

    global released_by_failed_capture
    device = torch.cuda.current_device()
    # The pools this capture begins are listed, since CUDAGraph.pool() refuses to name the pool
    # of a failed capture; on failure their uses are taken back (see gpupool_torch_graphs.cpp).
    if _graphs is not None:
        _graphs.gpupool_torch_watch_captures(device)
    failed = True
    try:
        with torch.cuda.graph(cuda_graph, **kwargs):
            yield
        failed = False
    finally:
        if _graphs is not None:
            released = _graphs.gpupool_torch_end_watch(device, 1 if failed else 0)
            if failed:
                released_by_failed_capture = released


def pool_stats(pool, device=0):
    """gpupool's statistics of PyTorch's private pool `pool` (a graph's .pool(), or
    torch.cuda.graph_pool_handle()) as stats() gives them; None when gpupool has no such pool."""
    if _graphs is None:
        return None
    pid = _graphs.gpupool_torch_pool_id(device, pool[0], pool[1])
    if pid == 0:
        return None
    s = _Stats()
    s.size = ctypes.sizeof(_Stats)
    _check(_bound().gpupool_pool_stats(device, pid, ctypes.byref(s)), "gpupool_pool_stats")
    return _flat(s)


def attach(lib=None):
    """Binds stats(), summary() and the rest to a gpupool without making it PyTorch's allocator.

    `lib`: a ctypes.CDLL or a path. Without it: the gpupool whose symbols the process already
    has in its global scope (the LD_PRELOAD shim exports the gpupool_* functions), else the
    library find_library() names ($GPUPOOL_LIB first; loading a path PyTorch already opened gives
    the same library, so the same allocator). Raises FileNotFoundError when none is found."""
    global _lib
    if isinstance(lib, (str, os.PathLike)):
        lib = ctypes.CDLL(os.fspath(lib))
    if lib is None:
        process = ctypes.CDLL(None)
        if hasattr(process, "gpupool_stats") and hasattr(process, "gpupool_last_error_message"):
            lib = process
        else:
            lib = ctypes.CDLL(find_library())
    _lib = _bind(lib)


def stats(device=0):
    """gpupool's statistics of `device` as a flat dict: 'reserved_bytes.all.peak', ... (bytes,
    counts), the keys of torch.cuda.memory_stats()."""
    s = _Stats()
    s.size = ctypes.sizeof(_Stats)
    _check(_bound().gpupool_stats(device, ctypes.byref(s)), "gpupool_stats")
    return _flat(s)


def _flat(s):
    out = {}
    for name in _ARRAYS:
        arr = getattr(s, name)
        for pool in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{pool}.{field}"] = getattr(getattr(arr, pool), field)
    for name in ("oversize_allocations", "oversize_segments", "unmapped_held_bytes", "sleeping_bytes"):
        for field in ("current", "peak", "allocated", "freed"):
            out[f"{name}.{field}"] = getattr(getattr(s, name), field)
    for name in _COUNTERS:
        out[name] = getattr(s, name)
    return out


def reset_peak_stats(device=0):
    _check(_bound().gpupool_reset_peak_stats(device), "gpupool_reset_peak_stats")


def summary(device=0):
    """gpupool's memory summary, in torch.cuda.memory_summary()'s layout."""
    needed = ctypes.c_size_t(0)
    _check(_bound().gpupool_memory_summary(device, None, 0, ctypes.byref(needed)), "gpupool_memory_summary")
    buf = ctypes.create_string_buffer(needed.value + 256)
    _check(_lib.gpupool_memory_summary(device, buf, len(buf), ctypes.byref(needed)), "gpupool_memory_summary")
    return buf.value.decode()


# GPUPOOL_HISTORY_CONTEXT_* of gpupool.h, by PyTorch's names for them.
# PyTorch's context=None, and GPUPOOL_RECORD_HISTORY's word for it.
_CONTEXTS = {None: 0, "none": 0, "state": 1, "alloc": 2, "all": 3}
# GPUPOOL_HISTORY_STACKS_*: added to the context.
_STACKS = {"all": 0, "python": 0x10, "native": 0x20}


def record_history(enabled=True, context="all", max_entries=100000, stacks="all"):
    """gpupool's torch.cuda.memory._record_memory_history: record the allocation history (the
    newest max_entries events per device, with the call stacks of `context`: None, "state",
    "alloc" or "all"), or stop and forget it (enabled=False). `stacks` as PyTorch's: "all" (the
    native frames and this thread's Python frames in place of the interpreter's), "python"
    (Python frames only), or gpupool's "native" (no Python frames)."""
    if context not in _CONTEXTS:
        raise ValueError(f"context {context!r}: expected None, 'none', 'state', 'alloc' or 'all'")
    if stacks not in _STACKS:
        raise ValueError(f"stacks {stacks!r}: expected 'all', 'python' or 'native'")
    _check(_bound().gpupool_record_history(1 if enabled else 0, max_entries, _CONTEXTS[context] | _STACKS[stacks]),
           "gpupool_record_history")


def dump_snapshot(path):
    """gpupool's torch.cuda.memory._dump_snapshot: write the snapshot pickle that PyTorch's
    memory viewer reads."""
    _check(_bound().gpupool_dump_snapshot(os.fsencode(path)), "gpupool_dump_snapshot")
