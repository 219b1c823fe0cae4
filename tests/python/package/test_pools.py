"""Private pools, per-thread routes and sleep and wake from Python (gpupool.Pool, use_pool,
sleep, wake; and gpupool.torch's use_pool/sleep/wake, which add only the device and the Pool
object, tested without PyTorch) on the simulated device, whose device memory is host memory:
contents written and read with ctypes."""

import ctypes
import threading

import pytest

import gpupool

MIB = 1 << 20


def fill(ptr, n, seed):
    ctypes.memmove(ptr, bytes((i * 31 + seed) & 0xFF for i in range(n)), n)


def holds(ptr, n, seed):
    return ctypes.string_at(ptr, n) == bytes((i * 31 + seed) & 0xFF for i in range(n))


def test_a_pool_routes_this_threads_allocations_and_sleeps_and_wakes():
    with gpupool.Pool(sleepable=True, device=0) as weights:
        with weights.use():
            a = gpupool.malloc(3 * MIB, 0, 0x10)
            b = gpupool.malloc(4096 + 17, 0, 0x20)
        fill(a, 3 * MIB, 1)
        fill(b, 4096 + 17, 2)
        s = weights.stats()
        assert s["allocated_bytes.all.current"] >= 3 * MIB + 4096
        reserved = s["reserved_bytes.all.current"]
        weights.sleep(offload=True)
        assert gpupool.stats(0)["sleeping_bytes.current"] == reserved
        with pytest.raises(gpupool.Error) as twice:
            weights.sleep()
        assert "sleep already" in twice.value.message
        weights.wake()
        assert holds(a, 3 * MIB, 1) and holds(b, 4096 + 17, 2)
        assert gpupool.stats(0)["sleeping_bytes.current"] == 0
        weights.sleep(offload="pinned")
        weights.wake()
        assert holds(a, 3 * MIB, 1) and holds(b, 4096 + 17, 2)
        staging, kept = gpupool.sleep_host_bytes(0)
        assert kept >= 3 * MIB + 4096
        assert weights.sleep_prepare() == kept  # the copy the pool keeps fits: nothing pinned again
        assert weights.sleep_prepare(offload=False) == 0
        with pytest.raises(ValueError):
            weights.sleep_prepare(offload=None)
        for bad in ("pageable", None, 0, 3):
            with pytest.raises(ValueError):
                weights.sleep(offload=bad)  # refused, not taken for discard or offload
        weights.sleep(offload=False)  # another mode: the pinned copy goes
        assert gpupool.sleep_host_bytes(0)[1] == 0
        weights.wake()
        assert gpupool.release_kept(weights.id, 0) == 0
        fill(a, 16, 3)  # discarded, but the address works
        gpupool.free(a)
        gpupool.free(b)
    assert weights.id == 0
    with pytest.raises(ValueError):
        weights.sleep()


def test_the_route_is_the_calling_threads_only():
    pool = gpupool.pool_create(sleepable=True)
    try:
        seen = {}
        with gpupool.use_pool(pool, 0):
            mine = gpupool.malloc(MIB, 0, 0x30)

            def other():
                seen["p"] = gpupool.malloc(MIB, 0, 0x30)

            t = threading.Thread(target=other)
            t.start()
            t.join()
        assert gpupool.pool_stats(pool, 0)["allocated_bytes.all.current"] == MIB
        gpupool.free(seen["p"])
        gpupool.free(mine)
    finally:
        gpupool.release_pool(pool, 0)


def test_the_default_pools_sleep_too():
    p = gpupool.malloc(2 * MIB, 0, 0x40)
    fill(p, 2 * MIB, 5)
    gpupool.sleep(0, offload=True, device=0)
    with pytest.raises(gpupool.Error):
        gpupool.malloc(MIB, 0, 0x40)  # a sleeping pool refuses allocations
    gpupool.wake(0, device=0)
    assert holds(p, 2 * MIB, 5)
    gpupool.free(p)


def test_bad_input_is_refused_and_changes_nothing():
    ordinary = gpupool.pool_create()
    try:
        with pytest.raises(gpupool.Error) as e:
            gpupool.sleep(ordinary, device=0)
        assert "gpupool_pool_create_sleepable" in e.value.message
        with pytest.raises(gpupool.Error):
            gpupool.wake(ordinary, device=0)  # it does not sleep
        with pytest.raises(gpupool.Error):
            gpupool.sleep(0x1234, device=0)  # never made
        with pytest.raises(gpupool.Error):
            gpupool.sleep(0, device=7)  # no such device
        with pytest.raises(TypeError):
            gpupool.sleep("pool")
        with pytest.raises(TypeError):
            gpupool.sleep(0, device=0.0)
        with pytest.raises(ValueError):
            gpupool.wake(-1)
        with pytest.raises(gpupool.Error):
            with gpupool.use_pool(0):  # the default pools need no route
                pass
        with gpupool.use_pool(ordinary, 0):
            with pytest.raises(gpupool.Error):
                with gpupool.use_pool(ordinary, 0):  # nested on one device
                    pass
    finally:
        gpupool.release_pool(ordinary, 0)


def test_torch_helpers_take_a_pool_or_its_id():
    # gpupool.torch imports torch only to find the current device: given a device, it does not.
    import gpupool.torch as gt

    pool = gpupool.Pool(sleepable=True, device=1)
    try:
        with gt.use_pool(pool, device=1):
            p = gpupool.malloc(MIB, 1, 0x50)
        fill(p, MIB, 9)
        gt.sleep(pool, offload=True, device=1)
        gt.wake(pool.id, device=1)
        assert holds(p, MIB, 9)
        gpupool.free(p)
    finally:
        pool.release()


def test_a_pool_limit_refuses_its_pool_only_and_reads_back():
    """gpupool.Pool(limit=...), set_pool_limit and pool_limit (issue 43): a pool past its limit
    raises OutOfMemoryError naming it while another pool allocates; bad limits raise and change
    nothing; gpupool.torch's route takes a Pool object."""
    import gpupool.torch as gt

    with gpupool.Pool(sleepable=False, device=0, limit=32 * MIB) as tenant, \
            gpupool.Pool(sleepable=False, device=0) as other:
        assert tenant.limit == 32 * MIB and other.limit is None
        assert tenant.stats()["pool_limit"] == 32 * MIB
        with tenant.use():
            a = gpupool.malloc(20 * MIB, 0, 0x10)
            with pytest.raises(gpupool.OutOfMemoryError) as refused:
                gpupool.malloc(20 * MIB, 0, 0x10)
        assert f"pool {tenant.id:#x}" in str(refused.value) and "limited to 32.00 MiB" in str(refused.value)
        with other.use():
            b = gpupool.malloc(64 * MIB, 0, 0x10)
        for bad, err in [(-1, ValueError), (2**63, ValueError), (1.5, TypeError), ("1", TypeError)]:
            with pytest.raises(err):
                tenant.limit = bad
        assert tenant.limit == 32 * MIB, "unchanged by the bad limits"
        with pytest.raises(ValueError):
            gpupool.Pool(sleepable=False, device=0, limit=-5)
        tenant.limit = None
        assert gpupool.pool_limit(tenant.id, 0) is None
        gt.set_pool_limit(tenant, 64 * MIB, device=0)
        assert gt.pool_limit(tenant.id, device=0) == 64 * MIB
        gpupool.set_pool_limit(0, 0, 0)
        assert gpupool.pool_limit(0, 0) == 0 and gpupool.stats(0)["pool_limit"] == 0
        gpupool.set_pool_limit(0, None, 0)
        assert gpupool.stats(0)["pool_limit"] == 2**63 - 1
        gpupool.free(a)
        gpupool.free(b)


def test_enable_peer_access():
    # The simulated host has two devices: device 1 may reach device 0's mapped memory.
    gpupool.enable_peer_access(1, 0)
    gpupool.enable_peer_access(1, 0)  # enabled already: nothing more
    for device, peer in ((0, 0), (0, 2), (-1, 0)):
        with pytest.raises(gpupool.Error):
            gpupool.enable_peer_access(device, peer)


def test_a_fallback_pool_serves_the_default_pools_once_the_device_is_full():
    """gpupool.Pool(use_on_oom=True) (torch.cuda.MemPool(use_on_oom=True), issue 43): once the
    device is full, a default allocation on the pool's stream takes a block of its cache, which
    counts in the pool and goes back to it; no_split=True hands out whole blocks; a sleepable
    pool with either flag is refused."""
    with pytest.raises(ValueError):
        gpupool.Pool(sleepable=True, use_on_oom=True)
    gpupool.empty_cache(1)
    with gpupool.Pool(device=1, use_on_oom=True) as spare, gpupool.Pool(device=1, no_split=True) as whole:
        assert not spare.sleepable and spare.use_on_oom and "use_on_oom=True" in repr(spare)
        with whole.use():
            w = gpupool.malloc(512, 1, 0x30)
        assert whole.stats()["allocated_bytes.all.current"] == 2 * MIB, "a whole 2 MiB block"
        gpupool.free(w)
        with spare.use():
            held = gpupool.malloc(4 * MIB, 1, 0x30)  # keeps the 20 MiB segment from release
            gpupool.free(gpupool.malloc(4 * MIB, 1, 0x30))
        # Full to the last 2 MiB page: 64 MiB blocks, then 2 MiB ones (a 64 MiB growth maps
        # 2 MiB pages where they round less, so the first fill alone leaves up to 62 MiB).
        filler = []
        for size in (64 * MIB, 2 * MIB):
            try:
                while True:
                    filler.append(gpupool.malloc(size, 1, 0x31))
            except gpupool.OutOfMemoryError:
                pass
        ooms = gpupool.stats(1)["num_ooms"]
        try:
            p = gpupool.malloc(8 * MIB, 1, 0x30)
            assert spare.stats()["allocated_bytes.all.current"] == 12 * MIB, "the fallback's block"
            assert gpupool.stats(1)["num_ooms"] == ooms, "no out-of-memory"
            gpupool.free(p)
            assert spare.stats()["allocated_bytes.all.current"] == 4 * MIB
        finally:
            for f in filler:
                gpupool.free(f)
            gpupool.free(held)
    gpupool.empty_cache(1)
