"""`import gpupool` on the simulated device: the package binds the library inside it, and each
call gives the C API's figures and errors (statistics, summary, configuration, history and
snapshots, tags, the live report, pinned memory), from several threads too."""

import ctypes
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import threading

import pytest

import gpupool

MIB = 1 << 20


def test_the_installed_package_and_its_library():
    lib = gpupool.bind()
    here = pathlib.Path(gpupool.__file__).resolve().parent
    if os.environ.get("GPUPOOL_TEST_INSTALLED") == "1":
        assert "site-packages" in str(here), f"gpupool imported from {here}, not the installed package"
        assert gpupool.bound_path() == str(here / "libgpupool.so")
        # PyTorch's graphs hooks load from the package, over the same libgpupool.so ($ORIGIN).
        graphs = ctypes.CDLL(str(here / "libgpupool_torch_graphs.so"))
        assert graphs.gpupool_torch_pool_id and graphs.gpupool_torch_begin_allocate_to_pool
        # The wheel's version is the crate's, and the library's.
        assert gpupool.version().startswith(importlib.metadata.version("gpupool"))
    assert lib.gpupool_version().decode() == gpupool.version()
    assert gpupool.device_count() == 2


def test_malloc_free_and_stats_agree():
    before = gpupool.stats(0)
    p = gpupool.malloc(3 * MIB, 0, 0x10)
    assert p != 0
    s = gpupool.stats(0)
    assert s["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 3 * MIB
    assert s["allocation.all.current"] == before["allocation.all.current"] + 1
    assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
    gpupool.free(p)
    # Reused on its stream, not on another.
    assert gpupool.malloc(3 * MIB, 0, 0x10) == p
    q = gpupool.malloc(3 * MIB, 0, 0x20)
    assert q != p
    gpupool.free(p)
    gpupool.free(q)
    assert gpupool.stats(0)["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert gpupool.malloc(0) == 0
    gpupool.free(0)


def test_errors_carry_gpupool_status_and_message():
    before = gpupool.stats(0)
    with pytest.raises(gpupool.OutOfMemoryError) as oom:
        gpupool.malloc(64 << 30, 0)
    assert isinstance(oom.value, MemoryError)
    assert oom.value.status == 2 and "out of memory" in oom.value.message
    assert gpupool.stats(0)["num_ooms"] == before["num_ooms"] + 1
    with pytest.raises(gpupool.Error) as bad:
        gpupool.malloc(MIB, 5)
    assert bad.value.status == 1 and "device 5" in bad.value.message
    # Foreign, interior and double frees: refused, nothing changes.
    local = ctypes.c_uint64()
    p = gpupool.malloc(MIB, 0)
    mid = gpupool.stats(0)
    for ptr in (ctypes.addressof(local), p + 512):
        with pytest.raises(gpupool.Error) as e:
            gpupool.free(ptr)
        assert e.value.status == 3
    assert gpupool.stats(0) == mid
    gpupool.free(p)
    with pytest.raises(gpupool.Error, match="double free"):
        gpupool.free(p)
    with pytest.raises(gpupool.Error):
        gpupool.stats(9)


def test_bad_arguments_are_refused_before_c():
    before = gpupool.stats(0)
    for call, exc in [
        (lambda: gpupool.malloc(-1), ValueError),
        (lambda: gpupool.malloc(1 << 64), ValueError),
        (lambda: gpupool.malloc(1.5), TypeError),
        (lambda: gpupool.malloc("1"), TypeError),
        (lambda: gpupool.malloc(1, 0, object()), TypeError),
        (lambda: gpupool.malloc(1, 0, -3), ValueError),
        (lambda: gpupool.free(1 << 70), ValueError),  # ctypes would wrap it to 0, a no-op free
        (lambda: gpupool.free(-5), ValueError),
        (lambda: gpupool.free(True), TypeError),
        (lambda: gpupool.record_history(True, "all", -1), ValueError),
        (lambda: gpupool.push_tag(None), TypeError),
        (lambda: gpupool.tag_stats(b"bytes"), TypeError),
        (lambda: gpupool.host_malloc(-1), ValueError),
        (lambda: gpupool.set_config(None), TypeError),
    ]:
        with pytest.raises(exc):
            call()
    assert gpupool.stats(0) == before


def test_streams_as_objects():
    class CupyLike:
        ptr = 0x30

    class TorchLike:
        cuda_stream = 0x30

    class NumbaLike:
        handle = ctypes.c_void_p(0x30)

    class CudaBindingsLike:  # numba-cuda's Stream.handle, a cuda-bindings CUstream
        handle = type("CUstream", (), {"__int__": lambda self: 0x30})()

    ptrs = []
    for s in (CupyLike(), TorchLike(), NumbaLike(), CudaBindingsLike(), 0x30):
        ptrs.append(gpupool.malloc(2 * MIB, 0, s))
        gpupool.free(ptrs[-1])
    # One stream, four spellings: the same cached block each time.
    assert len(set(ptrs)) == 1
    p = gpupool.malloc(MIB, 0, CupyLike())
    gpupool.record_stream(p, TorchLike())
    gpupool.free(p)
    # A stream about to be destroyed: waited for, since gpupool holds a block freed on it; one
    # it never served is not; the default streams are never destroyed.
    assert gpupool.stream_retire(CupyLike(), 0) is True
    assert gpupool.stream_retire(0x7770, 0) is False
    for default in (None, 0, 2):
        with pytest.raises(gpupool.Error, match="default streams"):
            gpupool.stream_retire(default, 0)


def test_summary_config_and_largest():
    assert "device ID 0" in gpupool.memory_summary(0)
    conf = gpupool.config()
    assert "expandable_segments" in conf
    # The configuration is fixed once the allocator started.
    with pytest.raises(gpupool.Error):
        gpupool.set_config("garbage_collection_threshold:2.0")
    assert 0 < gpupool.largest_allocatable(0) <= 1 << 30
    gpupool.reset_peak_stats(0)
    s = gpupool.stats(0)
    assert s["allocated_bytes.all.peak"] == s["allocated_bytes.all.current"]


def test_empty_cache_gives_back_cached_segments():
    p = gpupool.malloc(40 * MIB, 1)
    gpupool.free(p)
    assert gpupool.stats(1)["reserved_bytes.all.current"] >= 40 * MIB
    gpupool.empty_cache(1)
    s = gpupool.stats(1)
    assert s["reserved_bytes.all.current"] == 0 and s["allocated_bytes.all.current"] == 0


def test_history_and_snapshot_with_python_frames():
    gpupool.record_history(True, "all", 1000, stacks="python")
    try:
        p = gpupool.malloc(5 * MIB, 0)
        snap = gpupool.snapshot()
        gpupool.free(p)
    finally:
        gpupool.record_history(False)
    assert {"segments", "device_traces"} <= set(snap)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == p]
    assert allocs, "the allocation is in the trace"
    names = [f["name"] for f in allocs[-1]["frames"]]
    assert "test_history_and_snapshot_with_python_frames" in names
    with pytest.raises(ValueError):
        gpupool.record_history(True, "everything")


def test_tags_and_live_report():
    with gpupool.tag("encoder"):
        p = gpupool.malloc(4 * MIB, 0)
    t = gpupool.tag_stats("encoder")
    assert t["bytes.current"] == 4 * MIB and t["blocks.current"] == 1
    assert gpupool.tags()["encoder"] == t
    assert "tag encoder" in gpupool.live_report(0)
    gpupool.free(p)
    assert gpupool.tag_stats("encoder")["bytes.current"] == 0
    with pytest.raises(gpupool.Error):
        gpupool.pop_tag()  # nothing pushed on this thread
    with pytest.raises(gpupool.Error):
        gpupool.push_tag("bad\nname")
    with pytest.raises(gpupool.Error):
        gpupool.tag_stats("never-pushed")


def test_pinned_host_memory():
    before = gpupool.host_stats()
    p = gpupool.host_malloc(100_000)
    assert p != 0
    ctypes.memset(p, 7, 100_000)
    assert ctypes.string_at(p + 99_999, 1) == b"\x07"
    s = gpupool.host_stats()
    assert s["active_requests.current"] == before["active_requests.current"] + 1
    assert s["active_bytes.current"] >= before["active_bytes.current"] + 100_000
    gpupool.host_free(p)
    assert gpupool.host_stats()["active_requests.current"] == before["active_requests.current"]
    # A block a copy uses waits for the copy's event; the free itself succeeds at once.
    p = gpupool.host_malloc(4096)
    gpupool.host_record_event(p, 0x40)
    gpupool.host_free(p)
    with pytest.raises(gpupool.Error):
        gpupool.host_free(p)
    gpupool.host_empty_cache()
    gpupool.host_reset_peak_stats()


def test_threads_each_on_a_stream():
    before = gpupool.stats(0)
    errors = []

    def work(t):
        try:
            live = []
            for i in range(500):
                live.append(gpupool.malloc(512 + (i * 7919 + t * 104729) % (2 * MIB), 0, 0x100 + t))
                if len(live) > 3:
                    gpupool.free(live.pop(i % len(live)))
            for p in live:
                gpupool.free(p)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    after = gpupool.stats(0)
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"] + 4000


def test_binding_another_library_is_refused(tmp_path):
    gpupool.bind()
    other = tmp_path / "libgpupool.so"
    other.write_bytes(b"")
    with pytest.raises(RuntimeError, match="already bound"):
        gpupool.bind(str(other))
    with pytest.raises(FileNotFoundError):
        gpupool.bind(str(tmp_path / "missing.so"))
    # The same path again is the same library.
    assert gpupool.bind(gpupool.bound_path()) is gpupool.bind()


def test_a_preloaded_gpupool_is_the_one_bound():
    # The LD_PRELOAD shim of the repository's build (scripts/test.sh builds it before this).
    preload = pathlib.Path(__file__).resolve().parents[3] / "target/release/libgpupool_preload.so"
    if not preload.exists():
        pytest.skip(f"{preload} not built")
    code = ("import gpupool; gpupool.malloc(1 << 20); print(gpupool.bound_path(), "
            "gpupool.stats()['allocated_bytes.all.current'])\n"
            "try:\n    gpupool.torch.install()\nexcept RuntimeError as e:\n"
            "    print('refused:', e)")
    env = dict(os.environ, LD_PRELOAD=str(preload))
    env.pop("GPUPOOL_LIB", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    # Bound to the shim's own allocator (no path), which counts the package's block.
    assert lines[0] == f"None {1 << 20}"
    # PyTorch's pluggable allocator needs a path: refused (before torch is imported).
    assert lines[1].startswith("refused: gpupool is the process's own (LD_PRELOAD)")
