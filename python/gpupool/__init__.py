"""gpupool from Python: PyTorch's CUDA caching allocator as a library, shared by every framework
in the process that takes an allocator plug-in.

    import gpupool
    gpupool.torch.install()      # PyTorch's allocator (before the first CUDA tensor)
    gpupool.cupy.install()       # CuPy's, on the same cache
    print(gpupool.memory_summary())

Submodules, imported on first use (none imports its framework before it is called):
`gpupool.torch` (PyTorch's pluggable allocator, CUDA graphs), `gpupool.cupy`
(cupy.cuda.set_allocator, pinned memory), `gpupool.numba` (an External Memory Management
plugin: NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba), `gpupool.onnxruntime` (the CUDA execution
provider's external allocator options).

Private pools and sleep (framework-free): gpupool.Pool(sleepable=True), use_pool(pool) (routes
the calling thread's allocations to a pool, as torch.cuda.use_mem_pool), sleep(pool, offload)
and wake(pool) (docs/sleep.md).

Everything here calls the C API of libgpupool.so (include/gpupool.h) through ctypes: sizes are
bytes, devices CUDA ordinals (-1 the current device), streams cudaStream_t values (an int, or
a framework's stream object). Every argument is checked before the call: an integer must be an
int (not a bool, a float or a str) in the range of its C type (a device a C int, a size a
size_t, a pool id a uint64_t), a name or a path must hold no NUL character; otherwise
TypeError or ValueError, and nothing is called. A failed call raises gpupool.Error
(gpupool.OutOfMemoryError, also a MemoryError, on out of memory) with gpupool's message. Every function is thread-safe.
The library is loaded on the first call: a gpupool the process already has (the LD_PRELOAD
shim's), else $GPUPOOL_LIB, else the one inside this package, else the repository's build
(gpupool.bind() chooses another before the first call).
The GPUPOOL_* variables (GPUPOOL_DRIVER=sim for the simulated device, GPUPOOL_CONF, ...) are
read at the first call that needs the allocator.
"""

import contextlib
import ctypes
import importlib
import os
import tempfile

from . import _structs
from ._lib import (Error, OutOfMemoryError, bind, bound_path, check, device as _device, find_library, lib, path as _path,
                   real, size as _size, stream_handle, text, unsigned)
from ._pools import (
    Pool, pool_create, pool_limit, release_kept, release_pool, set_pool_limit, sleep, sleep_host_bytes, sleep_prepare,
    use_pool, wake,
)

__all__ = [
    "Error", "OutOfMemoryError", "bind", "bound_path", "find_library", "version", "device_count",
    "malloc", "free", "record_stream", "stream_retire", "empty_cache", "set_memory_fraction", "largest_allocatable", "enable_peer_access",
    "segment_mapped_range",
    "stats", "pool_stats", "reset_peak_stats", "memory_summary", "set_config", "config",
    "record_history", "dump_snapshot", "snapshot", "set_memory_metadata", "get_memory_metadata",
    "annotate_memory", "push_tag", "pop_tag", "tag", "tag_stats",
    "tags", "live_report", "host_malloc", "host_free", "host_record_event", "host_empty_cache",
    "host_stats", "host_reset_peak_stats", "Pool", "pool_create", "release_pool", "use_pool", "sleep",
    "wake", "sleep_host_bytes", "sleep_prepare", "release_kept", "set_pool_limit", "pool_limit",
]
_SUBMODULES = ("torch", "cupy", "numba", "onnxruntime")


def __getattr__(name):
    # gpupool.torch and the others load on first use, so that `import gpupool` imports no
    # framework.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def version():
    """gpupool's version string (gpupool_version)."""
    return lib().gpupool_version().decode()


def device_count():
    """The number of devices gpupool's driver sees (gpupool_device_count)."""
    n = ctypes.c_int(0)
    check(lib().gpupool_device_count(ctypes.byref(n)), "gpupool_device_count")
    return n.value


def malloc(size, device=-1, stream=None):
    """`size` bytes of device memory on `device` for use on `stream` (gpupool_malloc): the
    address as an int, 0 for size 0. Not initialised; give it back with free()."""
    p = ctypes.c_void_p()
    size, device, stream = _size(size, "size"), _device(device), stream_handle(stream)
    check(lib().gpupool_malloc(ctypes.byref(p), size, device, stream), "gpupool_malloc")
    return p.value or 0


def free(ptr):
    """Gives back a block malloc() returned (gpupool_free); 0 does nothing. Raises Error for a
    pointer gpupool did not hand out, an interior pointer or a double free (nothing changes)."""
    check(lib().gpupool_free(unsigned(ptr, "ptr")), "gpupool_free")


def record_stream(ptr, stream):
    """The block at `ptr` is also used on `stream`: once freed, it waits for that stream's work
    queued so far before reuse (gpupool_record_stream, PyTorch's Tensor.record_stream)."""
    check(lib().gpupool_record_stream(unsigned(ptr, "ptr"), stream_handle(stream)), "gpupool_record_stream")


def stream_retire(stream, device=-1):
    """Call just before `stream` is destroyed (a CuPy or Numba stream collected, a
    cudaStreamDestroy): when gpupool holds anything of it, waits for its work
    (gpupool_stream_retire), so that the next stream CUDA gives the same handle, which gpupool
    cannot tell from it, does not reuse its freed blocks under its running kernels. Returns
    whether it waited. Raises Error for CUDA's default streams (None, 0, 1, 2) and for a stream
    that captures a graph. PyTorch's streams come from its pool and are never destroyed."""
    waited = ctypes.c_int(0)
    check(lib().gpupool_stream_retire(_device(device), stream_handle(stream), ctypes.byref(waited)),
          "gpupool_stream_retire")
    return bool(waited.value)


def empty_cache(device=-1):
    """Gives the cached free segments of `device` (-1: every device) back to the driver
    (gpupool_empty_cache, torch.cuda.empty_cache)."""
    check(lib().gpupool_empty_cache(_device(device)), "gpupool_empty_cache")


def set_memory_fraction(fraction, device=-1):
    """Caps gpupool's reserved memory on `device` at `fraction` of its memory
    (torch.cuda.set_per_process_memory_fraction). `fraction`: a number from 0 to 1 (a bool is
    refused: True is not 1.0)."""
    check(lib().gpupool_set_memory_fraction(real(fraction, "fraction"), _device(device)),
          "gpupool_set_memory_fraction")


def largest_allocatable(device=-1, stream=None):
    """The largest request that would succeed on `device` and `stream` now, in bytes
    (gpupool_largest_allocatable); an upper bound, stale as soon as it returns."""
    n = ctypes.c_size_t(0)
    check(lib().gpupool_largest_allocatable(_device(device), stream_handle(stream), ctypes.byref(n)),
          "gpupool_largest_allocatable")
    return n.value


def enable_peer_access(device, peer):
    """Makes the memory gpupool maps on `peer` reachable from kernels and copies on `device`
    (gpupool_enable_peer_access; PyTorch's CUDACachingAllocator::enablePeerAccess(dev,
    dev_to_access)): pages mapped now and from now on. PyTorch's pluggable allocator does not
    pass its enablePeerAccess on to gpupool, so a program under gpupool.torch that reads or copies
    across devices calls this. cudaDeviceEnablePeerAccess stays the program's job for other
    memory. Raises Error for a device out of range, device == peer, or a pair that cannot reach
    each other."""
    check(lib().gpupool_enable_peer_access(_device(device), _device(peer)), "gpupool_enable_peer_access")


def segment_mapped_range(ptr, dmabuf=False):
    """What a transport (NIXL, UCX, ibverbs, NCCL, Mooncake) registers for the memory at `ptr`
    (gpupool_segment_mapped_range; docs/transports.md): the whole mapped run around it, once for
    every tensor in it. `ptr`: any byte of a live allocation of gpupool's, as an int or an object
    with data_ptr() (a PyTorch tensor). Returns a dict: 'address' and 'bytes' (the run),
    'segment_address' and 'segment_bytes', 'device', 'expandable' (bool: the run grows and
    shrinks, as the segment observers' MAP and UNMAP say), 'stream', 'pool'; with dmabuf=True
    also 'dmabuf_fd', a dma-buf file descriptor of exactly the run
    (cuMemGetHandleForAddressRange) that the caller owns and closes with os.close. Raises Error
    for a pointer in no live block (freed, cached, unknown), a pool that sleeps, or a driver
    that cannot export dma-bufs (with dmabuf=True)."""
    if hasattr(ptr, "data_ptr"):
        ptr = ptr.data_ptr()
    r = _structs.MappedRange()
    fd = ctypes.c_int(-1)
    check(lib().gpupool_segment_mapped_range(unsigned(ptr, "ptr"), ctypes.byref(r),
                                             ctypes.byref(fd) if dmabuf else None), "gpupool_segment_mapped_range")
    out = {"address": r.address or 0, "bytes": r.bytes, "segment_address": r.segment_address or 0,
           "segment_bytes": r.segment_bytes, "device": r.device, "expandable": bool(r.expandable),
           "stream": r.stream or 0, "pool": r.pool}
    if dmabuf:
        out["dmabuf_fd"] = fd.value
    return out


def stats(device=0):
    """The statistics of `device` as a flat dict with torch.cuda.memory_stats()'s keys
    ('allocated_bytes.all.current', 'reserved_bytes.all.peak', 'num_ooms', ...), bytes and
    counts, plus gpupool's 'unmapped_held_bytes.*' and 'sleeping_bytes.*'."""
    s = _structs.sized(_structs.Stats)
    check(lib().gpupool_stats(_device(device), ctypes.byref(s)), "gpupool_stats")
    return _structs.flat_stats(s)


def pool_stats(pool, device=0):
    """The statistics of gpupool private pool `pool` (an id from gpupool_pool_create), as
    stats() gives them."""
    s = _structs.sized(_structs.Stats)
    check(lib().gpupool_pool_stats(_device(device), unsigned(pool, "pool"), ctypes.byref(s)), "gpupool_pool_stats")
    return _structs.flat_stats(s)


def reset_peak_stats(device=0):
    """Sets every peak of `device` to its current value (torch.cuda.reset_peak_memory_stats)."""
    check(lib().gpupool_reset_peak_stats(_device(device)), "gpupool_reset_peak_stats")


def _sized_string(call, fill):
    """The text a (buf, len, needed) function writes, with a buffer as large as it needs."""
    needed = ctypes.c_size_t(0)
    status = fill(None, 0, ctypes.byref(needed))
    if status != 0 and needed.value == 0:
        check(status, call)
    while True:
        buf = ctypes.create_string_buffer(needed.value + 1)
        status = fill(buf, len(buf), ctypes.byref(needed))
        if status == 0:
            return buf.value.decode()
        if needed.value < len(buf):
            check(status, call)


def memory_summary(device=0):
    """gpupool's memory summary of `device`, in torch.cuda.memory_summary()'s layout."""
    device = _device(device)
    return _sized_string("gpupool_memory_summary",
                         lambda b, n, need: lib().gpupool_memory_summary(device, b, n, need))


def set_config(conf):
    """Sets the configuration string (PYTORCH_CUDA_ALLOC_CONF's syntax and keys, as
    $GPUPOOL_CONF), before the first allocation (gpupool_set_config)."""
    check(lib().gpupool_set_config(text(conf, "conf")), "gpupool_set_config")


def config():
    """The configuration in force, every key with its value (gpupool_config_string)."""
    return _sized_string("gpupool_config_string", lambda b, n, need: lib().gpupool_config_string(b, n, need))


# GPUPOOL_HISTORY_CONTEXT_* by PyTorch's names; GPUPOOL_HISTORY_STACKS_* added to them.
_CONTEXTS = {None: 0, "none": 0, "state": 1, "alloc": 2, "all": 3}
_STACKS = {"all": 0, "python": 0x10, "native": 0x20}


def record_history(enabled=True, context="all", max_entries=100000, stacks="all"):
    """torch.cuda.memory._record_memory_history for gpupool: record the newest `max_entries`
    events per device with the call stacks of `context` (None, "state", "alloc", "all"), or
    stop and forget (enabled=False). `stacks`: "all" (native and Python frames), "python" or
    "native"."""
    if context not in _CONTEXTS:
        raise ValueError(f"context {context!r}: expected None, 'none', 'state', 'alloc' or 'all'")
    if stacks not in _STACKS:
        raise ValueError(f"stacks {stacks!r}: expected 'all', 'python' or 'native'")
    check(lib().gpupool_record_history(1 if enabled else 0, _size(max_entries, "max_entries"),
                                       _CONTEXTS[context] | _STACKS[stacks]),
          "gpupool_record_history")


def dump_snapshot(path, include_traces=True):
    """torch.cuda.memory._dump_snapshot for gpupool: writes the snapshot pickle that PyTorch's
    memory viewer reads (python -m torch.cuda._memory_viz trace_plot PATH -o PATH.html).
    include_traces=False (PyTorch's memory_snapshot(include_traces=False)) leaves every
    device's trace empty and costs what the segments cost, however long the history
    (gpupool_dump_snapshot_with)."""
    if not isinstance(include_traces, bool):
        raise TypeError(f"include_traces: expected a bool, got {type(include_traces).__name__}")
    check(lib().gpupool_dump_snapshot_with(_path(path, "path"), 1 if include_traces else 0),
          "gpupool_dump_snapshot_with")


def snapshot(include_traces=True):
    """The snapshot dump_snapshot() writes, unpickled: a dict with 'segments',
    'device_traces' and the rest of torch.cuda.memory._snapshot()'s layout."""
    import pickle

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "snapshot.pickle")
        dump_snapshot(path, include_traces)
        with open(path, "rb") as f:
            return pickle.load(f)


def set_memory_metadata(metadata):
    """torch.cuda.memory._set_memory_metadata for gpupool: every event this thread records from
    now on carries `metadata` as its 'user_metadata' (gpupool_set_memory_metadata). A str as
    it is, a dict as compact JSON (json.dumps with separators=(",", ":")), as PyTorch writes
    it; "" clears. Error for more than 65536 bytes of UTF-8, or text starting with { or [ that
    is not valid JSON (the thread's metadata is then unchanged)."""
    if isinstance(metadata, dict):
        import json

        metadata = json.dumps(metadata, separators=(",", ":"))
    check(lib().gpupool_set_memory_metadata(text(metadata, "metadata")), "gpupool_set_memory_metadata")


def get_memory_metadata():
    """torch.cuda.memory._get_memory_metadata for gpupool: this thread's metadata, "" when none
    (a dict's as its JSON)."""
    return _sized_string("gpupool_get_memory_metadata", lib().gpupool_get_memory_metadata)


def annotate_memory(ptr, metadata):
    """torch.cuda.memory._annotate_memory for gpupool: records an 'annotate' event for the live
    block at `ptr` (the address malloc() returned) with `metadata` (str, or a dict as compact
    JSON) as its 'user_metadata' (gpupool_annotate_memory). Nothing is recorded while history
    is off. Error for a pointer that is not a live block (freed, interior, unknown) or bad
    metadata (the rules of set_memory_metadata)."""
    if isinstance(metadata, dict):
        import json

        metadata = json.dumps(metadata, separators=(",", ":"))
    check(lib().gpupool_annotate_memory(unsigned(ptr, "ptr"), text(metadata, "metadata")),
          "gpupool_annotate_memory")


def push_tag(name):
    """Tags this thread's allocations with `name` until pop_tag() (gpupool_push_tag)."""
    check(lib().gpupool_push_tag(text(name, "name")), "gpupool_push_tag")


def pop_tag():
    """Pops this thread's innermost tag (gpupool_pop_tag)."""
    check(lib().gpupool_pop_tag(), "gpupool_pop_tag")


@contextlib.contextmanager
def tag(name):
    """`with gpupool.tag("encoder"): ...`: push_tag(name), then pop_tag() on the way out."""
    push_tag(name)
    try:
        yield
    finally:
        pop_tag()


def tag_stats(name):
    """The statistics of the blocks allocated under tag `name`: {'bytes.current': ...,
    'blocks.peak': ...} (gpupool_tag_stats)."""
    s = _structs.TagStats()
    check(lib().gpupool_tag_stats(text(name, "name"), ctypes.byref(s)), "gpupool_tag_stats")
    return _structs.flat_tag(s)


def tags():
    """Every tag pushed in the process, in the order first pushed, with its statistics:
    {name: tag_stats(name)} (gpupool_for_each_tag)."""
    out = {}

    def each(name, s, _user):
        out[name.decode()] = _structs.flat_tag(s.contents)

    check(lib().gpupool_for_each_tag(_structs.TAG_FN(each), None), "gpupool_for_each_tag")
    return out


def live_report(device=-1):
    """The live blocks of `device` grouped by tag and call stack, largest first
    (gpupool_live_report), as a string."""
    parts = []

    def out(text, _user):
        parts.append(text.decode("utf-8", "replace"))

    device = _device(device)
    check(lib().gpupool_live_report(device, _structs.OUTPUT_FN(out), None), "gpupool_live_report")
    return "".join(parts)


def host_malloc(size):
    """`size` bytes of pinned host memory from gpupool's pinned cache (gpupool_host_malloc,
    PyTorch's CachingHostAllocator): the address as an int, 0 for size 0."""
    p = ctypes.c_void_p()
    check(lib().gpupool_host_malloc(ctypes.byref(p), _size(size, "size")), "gpupool_host_malloc")
    return p.value or 0


def host_free(ptr):
    """Gives back pinned memory host_malloc() returned; reused once the copies recorded on it
    (host_record_event) are done (gpupool_host_free)."""
    check(lib().gpupool_host_free(unsigned(ptr, "ptr")), "gpupool_host_free")


def host_record_event(ptr, stream):
    """A copy on `stream` uses the pinned block at `ptr`: once freed, it waits for that copy
    (gpupool_host_record_event)."""
    check(lib().gpupool_host_record_event(unsigned(ptr, "ptr"), stream_handle(stream)), "gpupool_host_record_event")


def host_empty_cache():
    """Unpins and frees the cached free pinned blocks (gpupool_host_empty_cache)."""
    check(lib().gpupool_host_empty_cache(), "gpupool_host_empty_cache")


def host_stats():
    """The pinned allocator's statistics as a flat dict ('allocated_bytes.current',
    'active_requests.peak', 'num_host_alloc', ...; gpupool_host_stats)."""
    s = _structs.sized(_structs.HostStats)
    check(lib().gpupool_host_stats(ctypes.byref(s)), "gpupool_host_stats")
    return _structs.flat_host_stats(s)


def host_reset_peak_stats():
    """Sets the pinned allocator's peaks to their current values."""
    check(lib().gpupool_host_reset_peak_stats(), "gpupool_host_reset_peak_stats")
