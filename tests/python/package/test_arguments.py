"""Every argument the package passes to C is checked before the call (issue 40, defect 7):
ctypes wraps an int silently to its C type (device=2**32+1 reached gpupool as device 1), cuts
a C string at its first NUL ("/tmp/x\\0.pickle" wrote /tmp/x), raises its own
ctypes.ArgumentError for None, '0' or 1.0, and takes True for 1.0. Here each entry point is
given such arguments: each must raise TypeError or ValueError naming the argument, and change
nothing (no block, no statistic, no file, no tag)."""

import os

import pytest

import gpupool

WRAPS_TO_1 = 2**32 + 1  # device 1 once cut to a C int
TOO_BIG = [2**31, -(2**31) - 1, WRAPS_TO_1, 2**64 + 1]
NOT_INTS = [None, "0", 1.0, True, False, b"0", 0.0, 1 + 0j]

# Every function that takes a device, with the other arguments it needs.
DEVICE_CALLS = {
    "malloc": lambda d: gpupool.malloc(4096, device=d),
    "empty_cache": lambda d: gpupool.empty_cache(d),
    "set_memory_fraction": lambda d: gpupool.set_memory_fraction(1.0, d),
    "largest_allocatable": lambda d: gpupool.largest_allocatable(d),
    "stats": lambda d: gpupool.stats(d),
    "pool_stats": lambda d: gpupool.pool_stats(1, d),
    "reset_peak_stats": lambda d: gpupool.reset_peak_stats(d),
    "memory_summary": lambda d: gpupool.memory_summary(d),
    "live_report": lambda d: gpupool.live_report(d),
    "sleep": lambda d: gpupool.sleep(0, True, d),
    "wake": lambda d: gpupool.wake(0, d),
    "release_pool": lambda d: gpupool.release_pool(1, d),
    "sleep_host_bytes": lambda d: gpupool.sleep_host_bytes(d),
    "release_kept": lambda d: gpupool.release_kept(0, d),
    "use_pool": lambda d: gpupool.use_pool(1, d).__enter__(),
    "Pool": lambda d: gpupool.Pool(True, d),
}


def everything():
    """What a refused call must leave as it was: both devices' statistics, the pinned cache's."""
    return gpupool.stats(0), gpupool.stats(1), gpupool.host_stats()


@pytest.mark.parametrize("name", sorted(DEVICE_CALLS))
def test_a_device_out_of_a_c_int_is_refused_not_wrapped(name):
    before = everything()
    for d in TOO_BIG:
        with pytest.raises(ValueError, match="device"):
            DEVICE_CALLS[name](d)
    assert everything() == before


@pytest.mark.parametrize("name", sorted(DEVICE_CALLS))
def test_a_device_that_is_not_an_int_is_a_type_error(name):
    before = everything()
    for d in NOT_INTS:
        with pytest.raises(TypeError, match="device"):
            DEVICE_CALLS[name](d)
    assert everything() == before


def test_a_device_out_of_range_for_gpupool_is_its_error():
    # In a C int, but no such device: gpupool's own refusal, as before.
    for d in (2, -2, 2**31 - 1):
        with pytest.raises(gpupool.Error):
            gpupool.malloc(4096, device=d)


def test_integer_likes_are_taken_at_their_value():
    numpy = pytest.importorskip("numpy")
    p = gpupool.malloc(numpy.uint64(4096), device=numpy.int32(1))
    assert gpupool.stats(1)["allocated_bytes.all.current"] >= 4096
    gpupool.free(p)
    with pytest.raises(TypeError):
        gpupool.malloc(4096, device=numpy.float64(1.0))


def test_sizes_pool_ids_and_counts_fit_their_c_types():
    before = everything()
    for call, exc in [
        (lambda: gpupool.malloc(2**64), ValueError),
        (lambda: gpupool.malloc(-1), ValueError),
        (lambda: gpupool.host_malloc(2**64), ValueError),
        (lambda: gpupool.host_malloc(None), TypeError),
        (lambda: gpupool.pool_stats(2**64, 0), ValueError),
        (lambda: gpupool.pool_stats(-1, 0), ValueError),
        (lambda: gpupool.release_pool(2**64 + 1, 0), ValueError),
        (lambda: gpupool.sleep(2**64 + 1, True, 0), ValueError),
        (lambda: gpupool.record_history(True, "all", 2**64), ValueError),
        (lambda: gpupool.record_history(True, "all", 1.5), TypeError),
        (lambda: gpupool.record_stream(1, 2**64), ValueError),
        (lambda: gpupool.largest_allocatable(0, -1), ValueError),
    ]:
        with pytest.raises(exc):
            call()
    assert everything() == before


def test_set_memory_fraction_takes_numbers_only():
    for bad in (True, False, None, "0.5", b"1"):
        with pytest.raises(TypeError, match="fraction"):
            gpupool.set_memory_fraction(bad, 0)
    # A number out of 0 to 1 is gpupool's to refuse, as before.
    with pytest.raises(gpupool.Error):
        gpupool.set_memory_fraction(1.5, 0)
    gpupool.set_memory_fraction(1, 0)  # an int is a number


def test_a_nul_in_a_snapshot_path_is_refused_and_nothing_is_written(tmp_path):
    cut = tmp_path / "x"
    for path in (f"{cut}\0.pickle", os.fsencode(f"{cut}\0.pickle")):
        with pytest.raises(ValueError, match="NUL"):
            gpupool.dump_snapshot(path)
    assert not cut.exists(), "the path was cut at its NUL and written"
    for bad in (None, 3, 1.0):
        with pytest.raises(TypeError):
            gpupool.dump_snapshot(bad)
    # A PathLike is a path.
    gpupool.dump_snapshot(tmp_path / "ok.pickle")
    assert (tmp_path / "ok.pickle").stat().st_size > 0


def test_a_nul_in_a_tag_or_the_configuration_is_refused():
    with pytest.raises(ValueError, match="NUL"):
        gpupool.push_tag("defect7\0decoder")
    # Nothing was pushed: the thread has no tag to pop, and no tag "defect7" exists.
    with pytest.raises(gpupool.Error):
        gpupool.pop_tag()
    assert not [t for t in gpupool.tags() if t.startswith("defect7")]
    with pytest.raises(ValueError, match="NUL"):
        gpupool.tag_stats("defect7\0")
    with pytest.raises(ValueError, match="NUL"):
        gpupool.set_config("expandable_segments:False\0garbage")
    with pytest.raises(ValueError):
        gpupool.push_tag("\ud800")  # a lone surrogate: no UTF-8 for it
