"""Python frames in gpupool's allocation history: libgpupool loaded with ctypes on the simulated
device, its stacks carry the file, line and function of the Python code that allocated
(docs/history.md, "Python frames"). Run by CTest:

    GPUPOOL_DRIVER=sim GPUPOOL_LIB=<libgpupool.so> TEST_C_THREAD_LIB=<libgpupool_c_thread.so> \\
        python3 tests/python/test_python_frames.py

Prints '<passed> passed, <failed> failed' and exits 1 when a check failed."""

import ctypes
import gc
import os
import pickle
import sys
import tempfile
import threading
import weakref

passed = failed = 0
HERE = os.path.abspath(__file__)
ALL, PYTHON, NATIVE = 3, 3 | 0x10, 3 | 0x20  # GPUPOOL_HISTORY_CONTEXT_ALL [| _STACKS_...]


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAILED: {what}", file=sys.stderr)


lib = ctypes.CDLL(os.environ["GPUPOOL_LIB"])
lib.gpupool_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.gpupool_free.argtypes = [ctypes.c_void_p]
lib.gpupool_record_history.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_uint32]
lib.gpupool_dump_snapshot.argtypes = [ctypes.c_char_p]
tmp = tempfile.mkdtemp()


def record(context, enabled=1):
    assert lib.gpupool_record_history(enabled, 1 << 20, context) == 0


def malloc(size=1 << 20):
    p = ctypes.c_void_p()
    assert lib.gpupool_malloc(ctypes.byref(p), size, 0, None) == 0
    return p.value


MALLOC_LINE = malloc.__code__.co_firstlineno + 2  # the line of its gpupool_malloc call


def snapshot():
    path = os.path.join(tmp, "s.pickle")
    assert lib.gpupool_dump_snapshot(path.encode()) == 0
    with open(path, "rb") as f:
        return pickle.load(f)


def alloc_frames(snap, addr):
    """The frames of the newest alloc event of the block at addr."""
    events = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == addr]
    return events[-1]["frames"] if events else None


def ours(frames):
    """(function, line) of the frames of this file, in order."""
    return [(f["name"], f["line"]) for f in frames if f["filename"] == HERE]


def inner():
    line = sys._getframe().f_lineno + 1
    return malloc(), line


def outer():
    line = sys._getframe().f_lineno + 1
    p, inner_line = inner()
    return p, inner_line, line


# Stacks "all" (the default): native and Python frames, innermost first.
record(ALL)
p, inner_line, outer_line = outer()
snap = snapshot()
frames = alloc_frames(snap, p)
got = ours(frames)
want = [("malloc", MALLOC_LINE), ("inner", inner_line), ("outer", outer_line)]
check(got[:3] == want, f"malloc, inner then outer, on their lines: {got}")
check(any(f["filename"] == "??" or f["filename"].endswith((".c", ".h")) for f in frames),
      "native frames beside the Python ones")
keys = set(frames[0])
check(keys == {"filename", "line", "name"}, f"frames are {{filename, line, name}}: {keys}")
check(any(f["name"] == "<module>" and f["filename"] == HERE for f in frames), "the module's frame too")
first_py = next(i for i, f in enumerate(frames) if f["filename"] == HERE)
check(all(f["filename"] != HERE for f in frames[:first_py]), "the innermost Python frame is the first of its kind")
# The segment's blocks carry the same frames.
blk = [b for s in snap["segments"] for b in s["blocks"] if b["address"] == p]
check(blk and ours(blk[0]["frames"])[:3] == want, "the block's frames name the same lines")
lib.gpupool_free(p)

# Stacks "python": Python frames only.
record(PYTHON)
p, inner_line, outer_line = outer()
frames = alloc_frames(snapshot(), p)
want = [("malloc", MALLOC_LINE), ("inner", inner_line), ("outer", outer_line)]
check([(f["name"], f["line"]) for f in frames[:3]] == want, f"python only: innermost first: {frames[:3]}")
check(all(f["filename"] == HERE for f in frames), "python only: every frame is Python's")
lib.gpupool_free(p)

# Stacks "native": no Python frame.
record(NATIVE)
p, _, _ = outer()
check(ours(alloc_frames(snapshot(), p)) == [], "native only: no Python frame")
lib.gpupool_free(p)

# A thread that C started (no Python thread state) records no Python frame.
record(ALL)
c_thread = ctypes.CDLL(os.environ["TEST_C_THREAD_LIB"])
c_thread.alloc_on_c_thread.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
q = ctypes.c_void_p()
check(c_thread.alloc_on_c_thread(ctypes.cast(lib.gpupool_malloc, ctypes.c_void_p), 3 << 20, ctypes.byref(q)) == 0,
      "malloc on a C thread")
frames = alloc_frames(snapshot(), q.value)
check(frames is not None and not any(f["filename"].endswith(".py") for f in frames),
      f"a C thread's stack has no Python frame: {frames and [f['filename'] for f in frames][:8]}")
lib.gpupool_free(q)


# A deep recursion: the 128 innermost Python frames are kept.
def deep(n):
    if n == 0:
        return malloc(), sys._getframe().f_lineno
    return deep(n - 1)


sys.setrecursionlimit(5000)
record(PYTHON)
p, line = deep(1000)
frames = alloc_frames(snapshot(), p)
check(len(frames) == 128, f"1,000 Python frames deep: 128 kept, {len(frames)}")
check(frames[0]["name"] == "malloc" and (frames[1]["name"], frames[1]["line"]) == ("deep", line),
      f"the innermost kept: {frames[:2]}")
lib.gpupool_free(p)

# A code object that dies before the snapshot: the stack keeps it alive (a reference held), and
# gives it back when the history is cleared.
record(ALL)
src = "def ephemeral(malloc):\n    return malloc()\n"
ns = {}
exec(compile(src, "<ephemeral>", "exec"), ns)
code_ref = weakref.ref(ns["ephemeral"].__code__)
p = ns["ephemeral"](malloc)
del ns
gc.collect()
check(code_ref() is not None, "the code object of a recorded frame is held")
frames = alloc_frames(snapshot(), p)
check(any(f["filename"] == "<ephemeral>" and f["name"] == "ephemeral" and f["line"] == 2 for f in frames),
      "a function deleted before the snapshot is named")
lib.gpupool_free(p)
record(ALL, enabled=0)
gc.collect()
check(code_ref() is None, "clearing the history gives the code object back")

# Many Python threads allocating with history on, while another clears and restarts it.
record(ALL)
errors = []


def worker():
    try:
        for _ in range(200):
            p = malloc(1 << 16)
            lib.gpupool_free(p)
    except Exception as e:  # noqa: BLE001
        errors.append(e)


def toggler(stop):
    while not stop.is_set():
        record(ALL, enabled=0)
        record(ALL)


stop = threading.Event()
t = threading.Thread(target=toggler, args=(stop,))
t.start()
workers = [threading.Thread(target=worker) for _ in range(8)]
for w in workers:
    w.start()
for w in workers:
    w.join()
stop.set()
t.join()
check(not errors, f"threads allocate while history is cleared: {errors[:1]}")
# Their events that were kept name the worker.
snap = snapshot()
allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
named = [e for e in allocs if any(f["name"] == "worker" and f["filename"] == HERE for f in e["frames"])]
check(all(any(f["filename"] == HERE for f in e["frames"]) for e in allocs), "every alloc event has Python frames")
check(len(named) == len(allocs), f"every alloc names the worker: {len(named)} of {len(allocs)}")

print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
