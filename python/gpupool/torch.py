"""gpupool under PyTorch, through PyTorch's pluggable-allocator interface (docs/pytorch.md).

    import torch, gpupool
    gpupool.torch.install()          # before the first CUDA tensor
    ...
    print(gpupool.torch.summary())   # torch.cuda.memory_summary() is the native allocator's

install() makes the library the package is bound to (gpupool.bind(): $GPUPOOL_LIB, else the
one inside the package) PyTorch's CUDA allocator with
torch.cuda.memory.CUDAPluggableAllocator and change_current_allocator, and wires the optional
hooks: init, reset (torch.cuda.empty_cache), memory fraction
(torch.cuda.set_per_process_memory_fraction) and record_stream (Tensor.record_stream).

CUDA graphs: when libgpupool_torch_graphs.so (built from examples/python/
gpupool_torch_graphs.cpp, installed beside libgpupool.so) is found, install() also wires
PyTorch's private-pool hooks, so that torch.cuda.graph captures into a gpupool private pool
and its memory goes back when the graphs are reset. torch.cuda.graph leaks the pool of a
capture that fails; capture through gpupool.torch.graph(g) instead, which releases it (and
re-raises).

Pools and sleep: use_pool(pool) routes the calling thread's allocations to a gpupool private
pool (a gpupool.Pool, or its id) in a `with` block, as torch.cuda.use_mem_pool(pool) does for
the native allocator (whose MemPool and beginAllocateToPool a pluggable allocator does not
get: the route is gpupool's, per thread); sleep(pool, offload=True) and wake(pool) put a pool
made with gpupool.Pool(sleepable=True), or the default pools (0), to sleep and back:

    weights, cache = gpupool.Pool(), gpupool.Pool()
    with gpupool.torch.use_pool(weights):
        model = build_model().cuda()
    with gpupool.torch.use_pool(cache):
        out = model.generate(...)
    gpupool.torch.sleep(weights, offload=True)    # contents to host memory
    gpupool.torch.sleep(cache, offload=False)     # dropped
    ...
    gpupool.torch.wake(cache); gpupool.torch.wake(weights)

Fallback and unsplit pools: torch.cuda.MemPool(use_on_oom=True, no_split=True) does not reach
gpupool (a pluggable allocator gets neither flag: PyTorch's CUDAAllocator.setUseOnOOM and
setNoSplit default to "does not yet support"); make the pool gpupool's instead,
gpupool.Pool(use_on_oom=True) or gpupool.Pool(no_split=True), fill a fallback pool through
use_pool(pool), and the default pools' tensors that would fail with out of memory take its
cached blocks (docs/graphs.md, "Fallback and unsplit pools").

Budgets: set_pool_limit(pool, bytes) caps what one pool (a tenant: a model, an adapter, a
request's cache) may reserve on a device, its out-of-memory kept to itself (gpupool.Pool(
limit=...) sets it at creation); PyTorch has only the process-wide
set_per_process_memory_fraction. A refusal under the pluggable allocator is PyTorch's
out-of-memory there: gpupool's message (the pool, its limit, its use) on stderr and a NULL
storage.

With the pluggable allocator installed, torch.cuda.memory_stats() and friends do not report
gpupool's figures; stats() and summary() here do (gpupool.stats, gpupool.memory_summary).
Likewise record_history() and dump_snapshot() are gpupool's torch.cuda.memory.
_record_memory_history() and _dump_snapshot(), and write the same file for the same viewer;
set_memory_metadata(), get_memory_metadata(), annotate_memory() and annotate_tensor() its
_set_memory_metadata(), _get_memory_metadata(), _annotate_memory() and _annotate_tensor().
"""

import contextlib
import ctypes
import os

from . import _lib, _structs
from . import (  # noqa: F401 (re-exported)
    annotate_memory, dump_snapshot, get_memory_metadata, record_history, reset_peak_stats, set_memory_metadata, stats,
)
from . import memory_summary as summary  # noqa: F401
from ._lib import find_library  # noqa: F401

# gpupool_stats_t, for code written against examples/python/gpupool_torch.py.
_Stats = _structs.Stats
_graphs = None
# How many pools graph() released when its last failed capture raised.
released_by_failed_capture = 0


def install(path=None):
    """Makes gpupool PyTorch's CUDA allocator; call before anything allocates CUDA memory.
    `path`: the libgpupool.so to use (else the package's binding, gpupool.bind()). Returns the
    CUDAPluggableAllocator. Raises RuntimeError when the package is bound to another library,
    or to a gpupool PyTorch cannot open by path (the LD_PRELOAD shim's)."""
    global _graphs
    lib = _lib.bind(path)
    path = _lib.bound_path()
    if path is None:
        raise RuntimeError("gpupool is the process's own (LD_PRELOAD): PyTorch's pluggable allocator "
                           "needs a library path; run without the shim, or use attach()")
    import torch

    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "gpupool_torch_malloc", "gpupool_torch_free")
    native = allocator.allocator()
    hooks = [
        ("set_init_fn", "gpupool_torch_init"),
        ("set_reset_fn", "gpupool_torch_empty_cache"),
        ("set_memory_fraction_fn", "gpupool_torch_set_memory_fraction"),
        ("set_record_stream_fn", "gpupool_torch_record_stream"),
    ]
    for setter, symbol in hooks:
        getattr(native, setter)(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
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
    torch.cuda.graph_pool_handle()) as stats() gives them; None when gpupool has no such pool
    (or install() found no graphs library)."""
    if _graphs is None:
        return None
    device = _lib.device(device)
    pid = _graphs.gpupool_torch_pool_id(device, _lib.unsigned(pool[0], "pool[0]"), _lib.unsigned(pool[1], "pool[1]"))
    if pid == 0:
        return None
    from . import pool_stats as gpupool_pool_stats

    return gpupool_pool_stats(pid, device)


def attach(lib=None):
    """Binds stats(), summary() and the rest to a gpupool without making it PyTorch's allocator:
    `lib` a path (or a ctypes.CDLL, by its path), else the gpupool the process already has (the
    LD_PRELOAD shim's), else find_library(). The calls above bind on first use anyway; attach()
    chooses which library, and fails (OSError) when that library cannot be loaded."""
    if isinstance(lib, ctypes.CDLL):
        lib = lib._name
    _lib.bind(lib)


def _pool_id(pool):
    return pool.id if hasattr(pool, "id") else pool


def _torch_device(device):
    if device is not None:
        return device
    import torch

    return torch.cuda.current_device()


def use_pool(pool, device=None):
    """Routes the calling thread's allocations on `device` (None: torch.cuda.current_device()),
    every tensor it creates there on any stream, to gpupool private pool `pool` (a gpupool.Pool
    or an id) while the `with` block runs: torch.cuda.use_mem_pool's idiom, on gpupool's
    per-thread route (gpupool_begin_allocate_to_pool_thread). Tensors keep their pool when freed
    elsewhere. Raises gpupool.Error for pool 0, a pool never made, or nested routes on one
    device."""
    from . import use_pool as core_use_pool

    return core_use_pool(_pool_id(pool), _torch_device(device))


def set_pool_limit(pool, limit, device=None):
    """Sets the most bytes `pool` (a gpupool.Pool, its id, or 0 for the default pools) may
    reserve on `device` (None: torch.cuda.current_device()); None removes the limit
    (gpupool.set_pool_limit). The tensors of a pool over its limit are refused once its own free
    cache is released; other pools' tensors are not touched."""
    from . import set_pool_limit as core_set_pool_limit

    core_set_pool_limit(_pool_id(pool), limit, _torch_device(device))


def pool_limit(pool, device=None):
    """The limit of `pool` on `device` (None: current) in bytes, or None (gpupool.pool_limit)."""
    from . import pool_limit as core_pool_limit

    return core_pool_limit(_pool_id(pool), _torch_device(device))


def sleep(pool=0, offload=True, device=None):
    """Puts `pool` (a gpupool.Pool made sleepable, its id, or 0 for the default pools) on
    `device` (None: current) to sleep (gpupool.sleep): its tensors keep their addresses, their
    memory goes back to the driver (torch.cuda.mem_get_info's free rises by the pool's reserved
    bytes), their contents kept in host memory (`offload`) or dropped. No tensor of the pool may
    be used, nor allocated from it, until wake()."""
    from . import sleep as core_sleep

    core_sleep(_pool_id(pool), offload, _torch_device(device))


def wake(pool=0, device=None):
    """Wakes `pool` on `device` (None: current) (gpupool.wake): its tensors usable again, an
    offloaded pool's contents back bit for bit."""
    from . import wake as core_wake

    core_wake(_pool_id(pool), _torch_device(device))


def annotate_tensor(tensor, metadata):
    """torch.cuda.memory._annotate_tensor for gpupool: annotate_memory() on the base of the
    tensor's storage, so that views and offset tensors annotate their block."""
    if not tensor.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got device {tensor.device}")
    annotate_memory(tensor.untyped_storage().data_ptr(), metadata)
