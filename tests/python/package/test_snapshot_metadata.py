"""Annotated snapshots from Python (issue 43): set_memory_metadata, get_memory_metadata,
annotate_memory and snapshot(include_traces=False), as PyTorch's _set_memory_metadata,
_get_memory_metadata, _annotate_memory and memory_snapshot(include_traces=False) write them,
on the simulated device."""

import json
import re
import threading

import pytest

import gpupool

MIB = 1 << 20


@pytest.fixture
def history():
    gpupool.record_history(True, "alloc", 10000, stacks="native")
    try:
        yield
    finally:
        gpupool.set_memory_metadata("")
        gpupool.record_history(False)


def events(snap, ptr):
    return [e for e in snap["device_traces"][0] if e.get("addr") == ptr]


def test_metadata_rides_on_this_threads_events(history):
    gpupool.set_memory_metadata({"step": 7, "phase": "forward"})
    assert gpupool.get_memory_metadata() == '{"step":7,"phase":"forward"}'
    p = gpupool.malloc(MIB, 0)
    seen = {}

    def other():
        seen["meta"] = gpupool.get_memory_metadata()
        q = gpupool.malloc(MIB, 0)
        seen["q"] = q
        gpupool.free(q)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    gpupool.set_memory_metadata("")
    gpupool.free(p)
    snap = gpupool.snapshot()
    alloc = [e for e in events(snap, p) if e["action"] == "alloc"][-1]
    assert json.loads(alloc["user_metadata"]) == {"step": 7, "phase": "forward"}
    assert "user_metadata" not in [e for e in events(snap, p) if e["action"] == "free_requested"][-1]
    assert seen["meta"] == "", "metadata is per thread"
    assert all("user_metadata" not in e for e in events(snap, seen["q"]) if e["action"] == "alloc")


def test_annotations_of_live_blocks(history):
    p = gpupool.malloc(3 * MIB, 0)
    gpupool.annotate_memory(p, "retained by autograd")
    gpupool.annotate_memory(p, {"owner": "kv"})
    with pytest.raises(gpupool.Error, match="inside a block"):
        gpupool.annotate_memory(p + 256, "x")
    with pytest.raises(gpupool.Error, match="JSON"):
        gpupool.annotate_memory(p, "{not json")
    with pytest.raises(TypeError):
        gpupool.annotate_memory(p, b"bytes")
    gpupool.free(p)
    with pytest.raises(gpupool.Error, match="freed"):
        gpupool.annotate_memory(p, "late")
    notes = [e for e in events(gpupool.snapshot(), p) if e["action"] == "annotate"]
    assert [n["user_metadata"] for n in notes[-2:]] == ["retained by autograd", '{"owner":"kv"}']
    assert all(n["size"] == 3 * MIB for n in notes)


def test_bad_metadata_is_refused_and_the_old_kept(history):
    gpupool.set_memory_metadata("kept")
    for bad, why in [("[1,", "not valid JSON"), ("x" * 65537, "65536 bytes")]:
        with pytest.raises(gpupool.Error, match=why):
            gpupool.set_memory_metadata(bad)
        assert gpupool.get_memory_metadata() == "kept"
    with pytest.raises(ValueError):
        gpupool.set_memory_metadata("\ud800")  # a lone surrogate: not UTF-8
    with pytest.raises(TypeError):
        gpupool.set_memory_metadata(3)


def test_a_snapshot_without_traces(history):
    p = gpupool.malloc(2 * MIB, 0)
    lite = gpupool.snapshot(include_traces=False)
    full = gpupool.snapshot()
    gpupool.free(p)
    assert all(t == [] for t in lite["device_traces"])
    assert len(lite["device_traces"]) == len(full["device_traces"])
    assert [(g["address"], len(g["blocks"])) for g in lite["segments"]] == \
        [(g["address"], len(g["blocks"])) for g in full["segments"]]
    with pytest.raises(TypeError):
        gpupool.snapshot(include_traces=1)


def _memory_viz():
    """PyTorch's torch.cuda._memory_viz (stdlib-only Python): from torch when it is installed,
    else from the file $GPUPOOL_TORCH_MEMORY_VIZ names (a copy of torch/cuda/_memory_viz.py);
    None when neither."""
    import importlib.util
    import os

    try:
        from torch.cuda import _memory_viz

        return _memory_viz
    except ImportError:
        pass
    path = os.environ.get("GPUPOOL_TORCH_MEMORY_VIZ")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("_memory_viz", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pytorchs_memory_viz_reads_annotations_and_lite_snapshots(history):
    viz = _memory_viz()
    if viz is None:
        pytest.skip("needs torch, or GPUPOOL_TORCH_MEMORY_VIZ=path/to/torch/cuda/_memory_viz.py")
    gpupool.set_memory_metadata({"step": 1})
    p = gpupool.malloc(3 * MIB, 0)
    q = gpupool.malloc(4096, 0)
    gpupool.annotate_memory(p, "kv cache of request 7")
    gpupool.set_memory_metadata("")
    gpupool.free(q)
    full = gpupool.snapshot()
    lite = gpupool.snapshot(include_traces=False)
    gpupool.free(p)
    text = viz.trace(full)
    # PyTorch's own text rendering names the annotated allocation and prints the annotation.
    named = re.findall(r"^(\w+) = \S+\[\d+:3\.0MiB\]$", text, re.M)
    assert named, text
    name = named[-1]
    assert f"# annotate {name}: kv cache of request 7" in text, text
    assert viz.trace(lite) == "", "no device has a trace"
    same = lambda x: x  # noqa: E731 (no flame graph script: it would be downloaded)
    for data in (full, lite):
        viz.segsum(data)
        viz.segments(data, same)
        viz.memory(data, same)
        assert "add_local_files" in viz.trace_plot(data)
        assert "add_local_files" in viz.segment_plot(data)
