"""Private pools, routes to them, and sleep and wake (include/gpupool.h: gpupool_pool_create,
gpupool_pool_create_sleepable, gpupool_pool_create_ex, gpupool_begin_allocate_to_pool_thread, gpupool_end_allocate_to_pool,
gpupool_release_pool, gpupool_sleep, gpupool_wake; docs/sleep.md). Framework-free: gpupool.torch
builds PyTorch's idioms on these.

    weights = gpupool.Pool(sleepable=True)
    with gpupool.use_pool(weights):        # this thread's allocations on the device go there
        ...                                # load the model
    weights.sleep(offload=True)            # device memory back to the driver, contents to host
    weights.wake()                         # same addresses, same bytes
"""

import contextlib
import ctypes

from ._lib import check, device as _device, integer, lib, unsigned

# gpupool_sleep's modes (GPUPOOL_SLEEP_OFFLOAD, GPUPOOL_SLEEP_DISCARD,
# GPUPOOL_SLEEP_OFFLOAD_PINNED).
SLEEP_OFFLOAD = 1
SLEEP_DISCARD = 2
SLEEP_OFFLOAD_PINNED = 3


# gpupool_pool_create_ex's flags (GPUPOOL_POOL_USE_ON_OOM, GPUPOOL_POOL_NO_SPLIT).
POOL_USE_ON_OOM = 1
POOL_NO_SPLIT = 2


def pool_create(sleepable=False, use_on_oom=False, no_split=False):
    """A new private pool's id (gpupool_pool_create, or gpupool_pool_create_sleepable when
    `sleepable`: its memory on CUDA's virtual memory API, so that it may sleep). A pool is per
    device: its id names its memory on every device. Release it with release_pool().
    `use_on_oom` and `no_split` are torch.cuda.MemPool's (gpupool_pool_create_ex): the pool's
    cache serves the default pools' requests that would fail with out of memory; the pool never
    splits a block. Raises ValueError for a sleepable pool with either (gpupool makes none)."""
    pid = ctypes.c_uint64(0)
    flags = (POOL_USE_ON_OOM if use_on_oom else 0) | (POOL_NO_SPLIT if no_split else 0)
    if flags:
        if sleepable:
            raise ValueError("a sleepable pool takes neither use_on_oom nor no_split")
        check(lib().gpupool_pool_create_ex(ctypes.byref(pid), flags), "gpupool_pool_create_ex")
    elif sleepable:
        check(lib().gpupool_pool_create_sleepable(ctypes.byref(pid)), "gpupool_pool_create_sleepable")
    else:
        check(lib().gpupool_pool_create(ctypes.byref(pid)), "gpupool_pool_create")
    return pid.value


def release_pool(pool, device=-1):
    """Gives private pool `pool`'s memory on `device` (-1: current) back (gpupool_release_pool):
    its free segments at once, the rest as its blocks are freed. Raises Error for a sleeping pool."""
    check(lib().gpupool_release_pool(_device(device), unsigned(pool, "pool")), "gpupool_release_pool")


# gpupool_pool_set_limit's "no limit" (GPUPOOL_NO_LIMIT, UINT64_MAX).
NO_LIMIT = 2**64 - 1
INT64_MAX = 2**63 - 1


def set_pool_limit(pool, limit, device=-1):
    """Sets the most bytes `pool` (0: the device's default pools, every stream's) may reserve on
    `device` (-1: current) (gpupool_pool_set_limit; PyTorch has only the process-wide
    set_per_process_memory_fraction); None removes the limit. Past it, an allocation of the pool
    releases the pool's own free cache, then raises OutOfMemoryError naming the pool, its limit
    and its use; other pools are not touched. Releases nothing now. Raises ValueError for a
    negative limit or one over 2**63 - 1, Error for a pool never made or released."""
    raw = NO_LIMIT if limit is None else integer(limit, "limit", 0, INT64_MAX)
    check(lib().gpupool_pool_set_limit(_device(device), unsigned(pool, "pool"), raw), "gpupool_pool_set_limit")


def pool_limit(pool, device=-1):
    """The limit in bytes of `pool` (0: the default pools) on `device` (-1: current), or None
    (gpupool_pool_get_limit)."""
    out = ctypes.c_uint64(0)
    check(
        lib().gpupool_pool_get_limit(_device(device), unsigned(pool, "pool"), ctypes.byref(out)),
        "gpupool_pool_get_limit",
    )
    return None if out.value == NO_LIMIT else out.value


@contextlib.contextmanager
def use_pool(pool, device=-1):
    """Routes the calling thread's allocations on `device` (-1: current), on any stream, to
    private pool `pool` while the block runs (gpupool_begin_allocate_to_pool_thread; PyTorch's
    torch.cuda.use_mem_pool). Other threads are not routed. Raises Error for pool 0, a pool never
    made, or a thread routed already on the device."""
    pool = unsigned(pool, "pool")
    device = _device(device)
    check(lib().gpupool_begin_allocate_to_pool_thread(device, pool), "gpupool_begin_allocate_to_pool_thread")
    try:
        yield pool
    finally:
        check(lib().gpupool_end_allocate_to_pool(device, pool), "gpupool_end_allocate_to_pool")


def sleep(pool=0, offload=True, device=-1):
    """Puts `pool` (0: the device's default pools; else a pool made with sleepable=True) on
    `device` (-1: current) to sleep (gpupool_sleep): the work queued on its blocks is waited
    for, their contents copied to host memory (`offload`) or dropped, and every page of its
    memory given back to the driver; its blocks keep their addresses, and nothing may be
    allocated from it (nor its memory touched) until wake(). `offload="pinned"`
    (GPUPOOL_SLEEP_OFFLOAD_PINNED): the copy is pinned host memory the pool keeps after wake, so
    that its next sleeps and wakes copy at the bus's speed (see release_kept). Raises Error
    (nothing changed) for a pool that cannot sleep or sleeps already, ValueError for an
    `offload` that is none of True, False and "pinned" (None and 0 included), OutOfMemoryError when the host has no room for the copy."""
    mode = _sleep_mode(offload)
    check(lib().gpupool_sleep(_device(device), unsigned(pool, "pool"), mode), "gpupool_sleep")


def _sleep_mode(offload):
    if offload is True:
        return SLEEP_OFFLOAD
    if offload is False:
        return SLEEP_DISCARD
    if offload == "pinned":
        return SLEEP_OFFLOAD_PINNED
    # Not truthiness: None or 0 would drop the contents without a word.
    raise ValueError(f"offload must be True, False or 'pinned', not {offload!r}")


def sleep_prepare(pool=0, offload="pinned", device=-1):
    """Makes the host memory of a later sleep(pool, offload) ready now, so that the pool's first
    sleep runs as fast as the next ones (gpupool_sleep_prepare; vLLM allocates its backup before
    sleeping likewise): with offload="pinned", a pinned copy of each of the pool's streams' live
    bytes, held while the pool is awake (sleep_host_bytes()'s kept, release_kept() gives it
    back); with True, the staging ring; with False, nothing. Returns the pinned bytes held for
    the sleep. Raises Error (nothing changed) for a pool that cannot sleep or sleeps,
    OutOfMemoryError when the host cannot pin the copy, ValueError for an `offload` that is none
    of True, False and "pinned"."""
    mode = _sleep_mode(offload)
    n = ctypes.c_size_t(0)
    check(
        lib().gpupool_sleep_prepare(_device(device), unsigned(pool, "pool"), mode, ctypes.byref(n)),
        "gpupool_sleep_prepare",
    )
    return n.value


def wake(pool=0, device=-1):
    """Wakes `pool` on `device` (-1: current) (gpupool_wake): new memory at the same addresses,
    an offloaded pool's contents back bit for bit, its host copy freed. OutOfMemoryError when
    the device has no room (the pool still sleeps, its copy intact: free memory and call again)."""
    check(lib().gpupool_wake(_device(device), unsigned(pool, "pool")), "gpupool_wake")


def sleep_host_bytes(device=-1):
    """(staging, kept): bytes of pinned host memory sleep and wake hold on `device` (-1:
    current) (gpupool_sleep_host_bytes): the staging ring, and the copies pools keep after
    sleep(offload="pinned")."""
    staging, kept = ctypes.c_size_t(0), ctypes.c_size_t(0)
    check(
        lib().gpupool_sleep_host_bytes(_device(device), ctypes.byref(staging), ctypes.byref(kept)),
        "gpupool_sleep_host_bytes",
    )
    return staging.value, kept.value


def release_kept(pool=0, device=-1):
    """Gives back the pinned copy `pool` on `device` (-1: current) keeps after
    sleep(offload="pinned") (gpupool_sleep_release_kept); returns its bytes (0 while the pool
    sleeps: its copy is in use)."""
    n = ctypes.c_size_t(0)
    check(
        lib().gpupool_sleep_release_kept(_device(device), unsigned(pool, "pool"), ctypes.byref(n)),
        "gpupool_sleep_release_kept",
    )
    return n.value


class Pool:
    """A private pool of `device` (-1: current) that owns its id: use() routes the calling
    thread's allocations to it, sleep()/wake() put it to sleep and back (sleepable=True), stats()
    gives its statistics, release() (or the end of a `with Pool(...)` block) gives its memory
    back. `limit`: the most bytes it may reserve on its device (set_pool_limit; None: none),
    read and changed through the `limit` attribute. `use_on_oom` and `no_split` are
    torch.cuda.MemPool's (pool_create): a fallback pool for the default pools' out-of-memory
    requests, a pool that never splits a block; either makes the pool not sleepable (sleepable
    left None; True with either raises ValueError). The id is the `pool` argument of the
    functions above."""

    def __init__(self, sleepable=None, device=-1, limit=None, use_on_oom=False, no_split=False):
        self.device = _device(device)
        self.use_on_oom, self.no_split = bool(use_on_oom), bool(no_split)
        flagged = self.use_on_oom or self.no_split
        self.sleepable = (not flagged) if sleepable is None else bool(sleepable)
        self.id = pool_create(self.sleepable, self.use_on_oom, self.no_split)
        if limit is not None:
            try:
                set_pool_limit(self.id, limit, self.device)
            except BaseException:
                # A bad limit leaves no pool behind.
                self.release()
                raise

    @property
    def limit(self):
        """The most bytes the pool may reserve on its device, or None (pool_limit)."""
        return pool_limit(self._live(), self.device)

    @limit.setter
    def limit(self, value):
        set_pool_limit(self._live(), value, self.device)

    def use(self):
        """A context manager routing the calling thread's allocations here (use_pool)."""
        return use_pool(self._live(), self.device)

    def sleep(self, offload=True):
        """sleep(self.id, offload, device)."""
        sleep(self._live(), offload, self.device)

    def sleep_prepare(self, offload="pinned"):
        """sleep_prepare(self.id, offload, device): the pinned bytes held for the sleep."""
        return sleep_prepare(self._live(), offload, self.device)

    def wake(self):
        """wake(self.id, device)."""
        wake(self._live(), self.device)

    def stats(self):
        """The pool's statistics (gpupool.pool_stats) on its device (0 for -1)."""
        from . import pool_stats

        return pool_stats(self._live(), max(self.device, 0))

    def release(self):
        """Gives the pool's memory back (release_pool); later calls do nothing."""
        if self.id:
            pid, self.id = self.id, 0
            release_pool(pid, self.device)

    def _live(self):
        if not self.id:
            raise ValueError("the pool was released")
        return self.id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __repr__(self):
        return (f"gpupool.Pool(id={self.id:#x}, sleepable={self.sleepable}, device={self.device}, "
                f"use_on_oom={self.use_on_oom}, no_split={self.no_split})")
