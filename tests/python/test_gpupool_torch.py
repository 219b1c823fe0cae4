"""The PyTorch helper (examples/python/gpupool_torch.py, a forwarder to the package's gpupool.torch)
as a new user meets it, without PyTorch: calls before anything is bound bind $GPUPOOL_LIB,
attach() honours it, and the bound
calls report gpupool's figures. Run by CTest on the simulated device:

    GPUPOOL_DRIVER=sim GPUPOOL_LIB=<libgpupool.so> python3 tests/python/test_gpupool_torch.py

Prints '<passed> passed, <failed> failed' and exits 1 when a check failed."""

import ctypes
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples/python"))
import gpupool_torch  # noqa: E402

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAILED: {what}", file=sys.stderr)


def raises(fn, exc, needle):
    try:
        fn()
    except exc as e:
        return needle in str(e)
    return False


lib_path = os.environ["GPUPOOL_LIB"]

# Without install() or attach(), the first call binds the library itself ($GPUPOOL_LIB here).
check(gpupool_torch.stats()["allocated_bytes.all.current"] == 0, "stats() before binding binds $GPUPOOL_LIB")

# find_library() honours $GPUPOOL_LIB.
check(gpupool_torch.find_library() == lib_path, "find_library() returns $GPUPOOL_LIB")

# attach() with no argument: this process has no gpupool symbols, so it loads $GPUPOOL_LIB.
gpupool_torch.attach()
lib = ctypes.CDLL(lib_path)  # the same handle: one library, one allocator
lib.gpupool_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.gpupool_free.argtypes = [ctypes.c_void_p]
p = ctypes.c_void_p()
check(lib.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0, "gpupool_malloc on the simulated device")
s = gpupool_torch.stats()
check(s["allocated_bytes.all.current"] == 3 << 20, f"stats() sees the block: {s['allocated_bytes.all.current']}")
check(s["segment.all.current"] >= 1, "stats() sees its segment")
check(s["unmapped_held_bytes.current"] == 0, "stats() has the held pages, none without expandable segments")
# _Stats mirrors gpupool_stats_t field for field: the library writes exactly its size.
room = ctypes.create_string_buffer(ctypes.sizeof(gpupool_torch._Stats) + 256)
size = ctypes.c_uint32.from_buffer(room)
size.value = len(room)
check(lib.gpupool_stats(0, room) == 0 and size.value == ctypes.sizeof(gpupool_torch._Stats),
      f"gpupool_stats_t is {size.value} bytes, _Stats {ctypes.sizeof(gpupool_torch._Stats)}")
check("device ID 0" in gpupool_torch.summary(), "summary() is gpupool's memory summary")
gpupool_torch.record_history(True, "none", 100)
check(lib.gpupool_free(p) == 0, "gpupool_free")
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "s.pickle")
    gpupool_torch.dump_snapshot(path)
    check(os.path.getsize(path) > 0, "dump_snapshot() writes a file")
# A bad argument gets gpupool's own message.
check(raises(lambda: gpupool_torch.stats(7), RuntimeError, "gpupool_stats failed"),
      "stats() of a device out of range raises with gpupool's message")

# attach() of a path that does not exist fails loudly, and leaves the earlier binding.
check(raises(lambda: gpupool_torch.attach("/nonexistent/libgpupool.so"), OSError, "nonexistent"),
      "attach(bad path) raises OSError")
check(gpupool_torch.stats()["segment.all.current"] >= 1, "the earlier binding still works")

print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
