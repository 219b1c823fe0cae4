// GPU test of gpupool_segment_mapped_range with GPUPOOL_DRIVER=cuda: the whole mapped range
// of the segment under a pointer and a dma-buf descriptor of it
// (cuMemGetHandleForAddressRange, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), what an RDMA
// transport registers once per mapping (docs/transports.md).
//
//   test_dmabuf ordinary     expandable_segments:False: a cuMemAlloc segment is one range
//   test_dmabuf expandable   expandable_segments:True: the run of pages mapped side by side,
//                            grown by a second block and shrunk by gpupool_empty_cache, a new
//                            descriptor each time
//
// Each check prints a PASS or FAIL line; the exit status is 1 when one failed. Skips (exit 0)
// where the device cannot export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0). Prints
// what cuMemGetAddressRange answers for the same pointer (one physical allocation on
// expandable segments: why Mooncake #2511 failed) and the time of a descriptor. Kernel-free.
#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "gpupool.h"

static int passed = 0, failed = 0;

static void expect(bool ok, const char *what) {
  if (ok) {
    passed++;
    std::printf("PASS %s\n", what);
  } else {
    failed++;
    std::printf("FAIL %s (last gpupool error: %s)\n", what, gpupool_last_error_message());
  }
}

static const size_t MIB = size_t(1) << 20;

// The size of the dma-buf behind fd (lseek to its end), or -1.
static long long fd_size(int fd) { return (long long)lseek(fd, 0, SEEK_END); }

// Asks for ptr's range with a descriptor; checks the descriptor's size against the range,
// closes it and returns the range. `what` names the block in the lines printed.
static gpupool_mapped_range_t range_with_fd(void *ptr, const char *what) {
  gpupool_mapped_range_t r;
  std::memset(&r, 0, sizeof r);
  int fd = -1;
  auto t0 = std::chrono::steady_clock::now();
  gpupool_status st = gpupool_segment_mapped_range(ptr, &r, &fd);
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  char line[256];
  std::snprintf(line, sizeof line, "%s: a range and a dma-buf descriptor", what);
  expect(st == GPUPOOL_SUCCESS && fd >= 0, line);
  if (st != GPUPOOL_SUCCESS || fd < 0) return r;
  long long size = fd_size(fd);
  std::printf("  %s: range %p + %zu bytes (segment %p + %zu), fd %d of %lld bytes, %.1f us\n", what, r.address,
              r.bytes, r.segment_address, r.segment_bytes, fd, size, us);
  std::snprintf(line, sizeof line, "%s: lseek(fd, 0, SEEK_END) == the range's bytes", what);
  expect(size == (long long)r.bytes, line);
  std::snprintf(line, sizeof line, "%s: the range holds the pointer", what);
  uintptr_t a = (uintptr_t)r.address, p = (uintptr_t)ptr;
  expect(a <= p && p < a + r.bytes, line);
  std::snprintf(line, sizeof line, "%s: the range is whole host pages", what);
  long page = sysconf(_SC_PAGESIZE);
  expect(a % (uintptr_t)page == 0 && r.bytes % (size_t)page == 0, line);
  close(fd);
  return r;
}

// What the driver says of the allocation under ptr (cuMemGetAddressRange): printed only.
static void driver_view(void *ptr) {
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = cuMemGetAddressRange(&base, &size, (CUdeviceptr)(uintptr_t)ptr);
  if (r == CUDA_SUCCESS)
    std::printf("  cuMemGetAddressRange: %p + %zu bytes\n", (void *)(uintptr_t)base, size);
  else
    std::printf("  cuMemGetAddressRange: error %d\n", (int)r);
}

static void ordinary() {
  void *p = nullptr;
  expect(gpupool_malloc(&p, 3 * MIB, 0, nullptr) == GPUPOOL_SUCCESS, "ordinary: a 3 MiB block");
  if (!p) return;
  expect(cudaMemset(p, 1, 3 * MIB) == cudaSuccess, "ordinary: the block is device memory");
  gpupool_mapped_range_t r = range_with_fd((char *)p + 4096, "ordinary");
  expect(r.expandable == 0, "ordinary: the segment is not expandable");
  expect(r.address == r.segment_address && r.bytes == r.segment_bytes, "ordinary: the range is the whole segment");
  driver_view(p);
  expect(gpupool_free(p) == GPUPOOL_SUCCESS, "ordinary: free");
}

static void expandable() {
  void *p = nullptr, *q = nullptr;
  expect(gpupool_malloc(&p, 6 * MIB, 0, nullptr) == GPUPOOL_SUCCESS, "expandable: a 6 MiB block");
  if (!p) return;
  expect(cudaMemset(p, 1, 6 * MIB) == cudaSuccess, "expandable: the block is device memory");
  gpupool_mapped_range_t first = range_with_fd(p, "expandable, first block");
  expect(first.expandable == 1, "expandable: the segment is expandable");
  expect(first.bytes >= 6 * MIB && first.bytes < first.segment_bytes, "expandable: the run is the pages mapped");
  driver_view(p);
  // Growth: a second block maps pages after the first's; the run, asked again, covers both.
  expect(gpupool_malloc(&q, 64 * MIB, 0, nullptr) == GPUPOOL_SUCCESS, "expandable: a 64 MiB block grows it");
  if (!q) return;
  expect(cudaMemset(q, 2, 64 * MIB) == cudaSuccess, "expandable: the second block is device memory");
  gpupool_mapped_range_t grown = range_with_fd(q, "expandable, grown");
  expect(grown.address == first.address && grown.bytes >= first.bytes + 64 * MIB,
         "expandable: one run from the first block's start over both blocks");
  gpupool_mapped_range_t again;
  expect(gpupool_segment_mapped_range(p, &again, nullptr) == GPUPOOL_SUCCESS && again.bytes == grown.bytes,
         "expandable: the first block's run grew with it");
  driver_view(q);
  // Shrink: the second block freed, its pages unmapped; a new descriptor of the smaller run.
  expect(gpupool_free(q) == GPUPOOL_SUCCESS, "expandable: free the second block");
  expect(gpupool_empty_cache(0) == GPUPOOL_SUCCESS, "expandable: empty_cache unmaps its pages");
  gpupool_mapped_range_t shrunk = range_with_fd(p, "expandable, shrunk");
  expect(shrunk.address == first.address && shrunk.bytes == first.bytes, "expandable: back to the first run");
  gpupool_mapped_range_t bad;
  expect(gpupool_segment_mapped_range(q, &bad, nullptr) == GPUPOOL_ERROR_INVALID_POINTER,
         "expandable: the freed block is refused");
  expect(gpupool_free(p) == GPUPOOL_SUCCESS, "expandable: free");
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "expandable";
  bool exp = std::strcmp(mode, "expandable") == 0;
  if (!exp && std::strcmp(mode, "ordinary") != 0) {
    std::fprintf(stderr, "usage: test_dmabuf ordinary|expandable\n");
    return 2;
  }
  // Before anything else of gpupool: the configuration is fixed at the first allocation.
  expect(gpupool_set_config(exp ? "expandable_segments:True" : "expandable_segments:False") == GPUPOOL_SUCCESS,
         "gpupool_set_config");
  if (cudaSetDevice(0) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    std::printf("FAIL no device\n");
    return 1;
  }
  CUdevice dev;
  int dmabuf = 0;
  if (cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDeviceGetAttribute(&dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) != CUDA_SUCCESS) {
    std::printf("FAIL cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)\n");
    return 1;
  }
  int rdma_vmm = 0;
  cuDeviceGetAttribute(&rdma_vmm, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
  std::printf("test_dmabuf %s: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED %d, GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED %d\n",
              mode, dmabuf, rdma_vmm);
  if (dmabuf == 0) {
    std::printf("SKIP device 0 cannot export dma-bufs (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0)\n");
    return 0;
  }
  expect(gpupool_segment_mapped_range(nullptr, nullptr, nullptr) == GPUPOOL_ERROR_INVALID_VALUE,
         "a NULL range is refused");
  gpupool_mapped_range_t r;
  int fd = -7;
  expect(gpupool_segment_mapped_range(&r, &r, &fd) == GPUPOOL_ERROR_INVALID_POINTER && fd == -7,
         "a host pointer is refused, no descriptor written");
  if (exp)
    expandable();
  else
    ordinary();
  expect(gpupool_empty_cache(0) == GPUPOOL_SUCCESS, "empty_cache");
  std::printf("test_dmabuf %s: %d passed, %d failed\n", mode, passed, failed);
  return failed == 0 ? 0 : 1;
}
