"""gpupool.segment_mapped_range on the simulated device: the run a transport registers for a
pointer (gpupool_segment_mapped_range), its dma-buf descriptor, and the errors."""

import os

import pytest

import gpupool

MIB = 1 << 20


def test_a_block_and_its_interior_share_one_run_with_a_descriptor_of_its_size():
    a = gpupool.malloc(3 * MIB, device=0)
    b = gpupool.malloc(1 * MIB, device=0)
    try:
        r = gpupool.segment_mapped_range(a)
        assert r["address"] <= a and a + 3 * MIB <= r["address"] + r["bytes"]
        assert r["segment_address"] <= r["address"]
        assert r["address"] + r["bytes"] <= r["segment_address"] + r["segment_bytes"]
        assert r["device"] == 0 and r["pool"] == 0 and r["bytes"] % 4096 == 0
        assert gpupool.segment_mapped_range(a + 12345) == r, "an interior pointer names the same run"
        with_fd = gpupool.segment_mapped_range(a, dmabuf=True)
        fd = with_fd.pop("dmabuf_fd")
        try:
            assert fd >= 0
            assert with_fd == r
            assert os.lseek(fd, 0, os.SEEK_END) == r["bytes"], "the descriptor covers exactly the run"
        finally:
            os.close(fd)
    finally:
        gpupool.free(b)
        gpupool.free(a)


def test_a_tensor_like_object_is_read_through_data_ptr():
    a = gpupool.malloc(MIB, device=1)

    class Tensor:
        def data_ptr(self):
            return a

    try:
        assert gpupool.segment_mapped_range(Tensor())["device"] == 1
    finally:
        gpupool.free(a)


def test_freed_unknown_and_bad_pointers_raise_and_leave_no_descriptor_open():
    a = gpupool.malloc(MIB, device=0)
    gpupool.free(a)
    before = len(os.listdir("/proc/self/fd"))
    for bad in (a, 0, 1, 2**63):
        with pytest.raises(gpupool.Error, match="gpupool_segment_mapped_range"):
            gpupool.segment_mapped_range(bad, dmabuf=True)
    assert len(os.listdir("/proc/self/fd")) == before
    with pytest.raises((TypeError, ValueError)):
        gpupool.segment_mapped_range(-1)
    with pytest.raises(TypeError):
        gpupool.segment_mapped_range("0x1000")
