// GPU tests of gpupool's expandable segments (gpupool_set_config("expandable_segments:True"),
// PyTorch's expandable_segments) with GPUPOOL_DRIVER=cuda: a segment growing across a page
// boundary (contents kept, reserved grown by whole pages, consecutive blocks contiguous), every
// page given back by gpupool_empty_cache, out of memory in the middle of a growth rolled back,
// a stream destroyed before gpupool_empty_cache (PyTorch 2.11 dies there), and a second device
// writing and reading a block of the first, without and with peer access enabled. Built with
// nvcc against an installed gpupool; prints "N passed, M failed" and exits 1 on a failure.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gpupool.h"
#include "check.h"

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;
static const size_t GIB = size_t(1) << 30;
// The driver's granularity for device memory on these GPUs (GPU.md): every page gpupool maps
// is a multiple of it.
static const long long GRANULARITY = 2 * (long long)MIB;

__host__ __device__ inline uint32_t pattern(size_t i, uint32_t tag) { return (uint32_t)(i * 2654435761u) ^ tag; }

__global__ void fill(uint32_t *p, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern(i, tag);
}

__global__ void count_wrong(const uint32_t *p, size_t n, uint32_t tag, unsigned long long *wrong) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    mine += p[i] != pattern(i, tag);
  if (mine) atomicAdd(wrong, mine);
}

// Spins for about `cycles` clock cycles, then fills: a kernel still running on a block after
// the host has freed it.
__global__ void spin_then_fill(uint32_t *p, size_t n, uint32_t tag, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern(i, tag);
}

static void launch_fill(void *p, size_t bytes, uint32_t tag, cudaStream_t s) {
  fill<<<256, 256, 0, s>>>(static_cast<uint32_t *>(p), bytes / 4, tag);
  CUDA_OK(cudaGetLastError());
}

// Words of [p, p + bytes) on the current device that differ from pattern(., tag), copied to the
// host and compared there; -1 when the copy fails.
static long long wrong_words(const void *p, size_t bytes, uint32_t tag) {
  std::vector<uint32_t> host(bytes / 4);
  if (cudaMemcpy(host.data(), p, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return -1;
  long long wrong = 0;
  for (size_t i = 0; i < host.size(); i++) wrong += host[i] != pattern(i, tag);
  return wrong;
}

// The same, counted by a kernel on the current device.
static long long wrong_words_on_device(const void *p, size_t bytes, uint32_t tag) {
  unsigned long long *wrong = nullptr, host = 0;
  if (cudaMalloc((void **)&wrong, sizeof *wrong) != cudaSuccess) return -1;
  CUDA_OK(cudaMemset(wrong, 0, sizeof *wrong));
  count_wrong<<<256, 256>>>(static_cast<const uint32_t *>(p), bytes / 4, tag, wrong);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpy(&host, wrong, sizeof host, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(wrong));
  return (long long)host;
}

static gpupool_stats_t stats(int device = 0) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(device, &s));
  return s;
}

static long long reserved(int device = 0) { return stats(device).reserved_bytes.all.current; }

static size_t free_bytes() {
  size_t free = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free, &total));
  return free;
}

static std::string config_text() {
  size_t needed = 0;
  char buf[4096];
  if (gpupool_config_string(buf, sizeof buf, &needed) != GPUPOOL_SUCCESS) return std::string("(error: ") + gpupool_last_error_message() + ")";
  return buf;
}

// text lower-cased and without spaces, to find a key:value pair whatever the spelling of True.
static std::string squeezed(const std::string &text) {
  std::string out;
  for (char c : text)
    if (!isspace((unsigned char)c)) out += (char)tolower((unsigned char)c);
  return out;
}

// Launches every kernel once, so that loading their code (lazy loading, on first launch) takes
// its device memory before any free-memory figure is read.
static void load_kernels() {
  void *scratch = nullptr;
  CUDA_OK(cudaMalloc(&scratch, 4096));
  launch_fill(scratch, 4096, 0, nullptr);
  spin_then_fill<<<1, 1>>>(static_cast<uint32_t *>(scratch), 1, 0, 0);
  CUDA_OK(cudaGetLastError());
  CHECK(wrong_words_on_device(scratch, 4, 0) >= 0);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(scratch));
}

// A segment grows in place: the first block on a new stream maps whole pages; a block that fits
// the rest of them exactly is served without a map, right after; the next block maps new pages
// at the end of the segment, right after; a block that starts in the free tail of a page and
// needs more spans the boundary between a page mapped earlier and one mapped for it. Kernels
// write each block before and after the growths; the host reads everything back. Then
// gpupool_empty_cache gives every page back, to the byte. Returns the page size seen (bytes),
// 0 when it could not be determined.
static long long test_growth() {
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  size_t free0 = free_bytes();
  gpupool_stats_t st0 = stats();

  char *a = nullptr;
  CHECK_OK(gpupool_malloc((void **)&a, 2 * MIB, 0, s));
  gpupool_stats_t st1 = stats();
  long long page = st1.reserved_bytes.all.current - st0.reserved_bytes.all.current;
  CHECK(page >= GRANULARITY && page % GRANULARITY == 0);
  CHECK(st1.num_device_alloc - st0.num_device_alloc == 1);
  CHECK((uintptr_t)a % GRANULARITY == 0);
  printf("growth: a 2 MiB block on a new stream mapped %lld MiB (the page), %lld map\n", page >> 20,
         (long long)(st1.num_device_alloc - st0.num_device_alloc));
  if (page < GRANULARITY || page % GRANULARITY != 0) {
    CHECK_OK(gpupool_free(a));
    CUDA_OK(cudaStreamDestroy(s));
    return 0;
  }
  launch_fill(a, 2 * MIB, 1, s);

  // The rest of the mapped page, exactly: no growth, right after a.
  char *a2 = nullptr;
  size_t a2_size = (size_t)page - 2 * MIB;
  if (a2_size > 0) {
    CHECK_OK(gpupool_malloc((void **)&a2, a2_size, 0, s));
    gpupool_stats_t st = stats();
    CHECK(st.reserved_bytes.all.current == st1.reserved_bytes.all.current);
    CHECK(st.num_device_alloc == st1.num_device_alloc);
    CHECK(a2 == a + 2 * MIB);
    launch_fill(a2, a2_size, 2, s);
  }

  // Every mapped byte is in use: b maps new pages at the end of the segment.
  const size_t b_size = 3 * MIB;
  long long b_pages = ((long long)b_size + page - 1) / page;
  gpupool_stats_t before_b = stats();
  char *b = nullptr;
  CHECK_OK(gpupool_malloc((void **)&b, b_size, 0, s));
  gpupool_stats_t after_b = stats();
  long long grew_b = after_b.reserved_bytes.all.current - before_b.reserved_bytes.all.current;
  int64_t maps_b = after_b.num_device_alloc - before_b.num_device_alloc;
  CHECK(grew_b == b_pages * page);
  CHECK(maps_b >= 1 && maps_b <= b_pages);
  CHECK(b == a + page);
  launch_fill(b, b_size, 3, s);
  printf("growth: a 3 MiB block grew the segment by %lld MiB (%lld pages, %lld maps), at a + %lld MiB\n",
         grew_b >> 20, b_pages, (long long)maps_b, (long long)(b - a) >> 20);

  // c starts in the free tail of b's last page and needs one page more: it spans the boundary.
  const size_t c_size = (size_t)page;
  char *c = nullptr;
  CHECK_OK(gpupool_malloc((void **)&c, c_size, 0, s));
  gpupool_stats_t after_c = stats();
  long long grew_c = after_c.reserved_bytes.all.current - after_b.reserved_bytes.all.current;
  CHECK(grew_c == page);
  CHECK(c == b + b_size);
  launch_fill(c, c_size, 4, s);
  printf("growth: a %lld MiB block from the free tail of the last page grew the segment by %lld MiB, at b + %lld MiB\n",
         page >> 20, grew_c >> 20, (long long)(c - b) >> 20);

  // Everything written before and after the growths reads back.
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(wrong_words(a, 2 * MIB, 1) == 0);
  if (a2 != nullptr) CHECK(wrong_words(a2, a2_size, 2) == 0);
  CHECK(wrong_words(b, b_size, 3) == 0);
  CHECK(wrong_words(c, c_size, 4) == 0);

  // One kernel over the whole range, as one buffer: the pages form one contiguous mapping.
  bool contiguous = (a2 == nullptr || a2 == a + 2 * MIB) && b == a + page && c == b + b_size;
  if (contiguous) {
    size_t span = (size_t)(c + c_size - a);
    launch_fill(a, span, 5, s);
    CUDA_OK(cudaStreamSynchronize(s));
    long long wrong = wrong_words(a, span, 5);
    CHECK(wrong == 0);
    printf("growth: one kernel over the %zu MiB from a to the end of c: %lld words wrong\n", span >> 20, wrong);
  }

  CHECK_OK(gpupool_free(a));
  if (a2 != nullptr) CHECK_OK(gpupool_free(a2));
  CHECK_OK(gpupool_free(b));
  CHECK_OK(gpupool_free(c));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK_OK(gpupool_empty_cache(0));
  size_t free1 = free_bytes();
  CHECK(reserved() == st0.reserved_bytes.all.current);
  CHECK(free1 == free0);
  printf("growth: after empty_cache, reserved %lld bytes; free memory %zu before, %zu after\n", reserved(), free0,
         free1);
  CUDA_OK(cudaStreamDestroy(s));
  return page;
}

// Fills the device with 1 GiB blocks through gpupool until one fails, then asks for more pages
// than are left, so that the growth maps some and fails on the next: reserved and free memory
// must be as before the call. Freed memory then serves the same request.
static void test_out_of_memory(long long page) {
  size_t free0 = free_bytes();
  long long reserved0 = reserved();
  std::vector<void *> chunks;
  long long before_fail = 0;
  gpupool_status last = GPUPOOL_SUCCESS;
  for (;;) {
    long long before = reserved();
    void *p = nullptr;
    last = gpupool_malloc(&p, GIB, 0, nullptr);
    if (last != GPUPOOL_SUCCESS) {
      before_fail = before;
      break;
    }
    chunks.push_back(p);
  }
  CHECK(last == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(chunks.size() > 4);
  CHECK(reserved() == before_fail);
  printf("out-of-memory: %zu blocks of 1 GiB, then: %s\n", chunks.size(), gpupool_last_error_message());
  if (chunks.size() < 2) {
    for (void *p : chunks) CHECK_OK(gpupool_free(p));
    return;
  }

  // At least one page must be free for the growth to fail halfway.
  size_t left = free_bytes();
  if ((long long)left < page) {
    CHECK_OK(gpupool_free(chunks.back()));
    chunks.pop_back();
    CHECK_OK(gpupool_empty_cache(0));
    left = free_bytes();
  }
  long long pages_left = (long long)left / page;
  size_t want = (size_t)((pages_left + 2) * page);
  long long before = reserved();
  int64_t ooms = stats().num_ooms;
  void *p = nullptr;
  CHECK(gpupool_malloc(&p, want, 0, nullptr) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(reserved() == before);
  CHECK(stats().num_ooms == ooms + 1);
  size_t left_after = free_bytes();
  CHECK(left_after == left);
  printf("out-of-memory: %zu MiB asked with %lld pages of %lld MiB free: failed, reserved %lld -> %lld, free memory "
         "%zu -> %zu bytes\n",
         want >> 20, pages_left, page >> 20, before, reserved(), left, left_after);

  // The last block sits at the end of the segment, where the request grows: freed, it serves.
  CHECK_OK(gpupool_free(chunks.back()));
  chunks.pop_back();
  CHECK_OK(gpupool_malloc(&p, want, 0, nullptr));
  printf("out-of-memory: after freeing 1 GiB, the same %zu MiB served\n", want >> 20);
  CHECK_OK(gpupool_free(p));
  for (void *q : chunks) CHECK_OK(gpupool_free(q));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(reserved() == reserved0);
  CHECK(free_bytes() == free0);
}

// A stream that holds a segment is destroyed, with a kernel still writing a block freed on it,
// before gpupool_empty_cache: the call must neither crash (PyTorch 2.11 synchronises the
// destroyed stream there and dies) nor unmap the pages under the kernel, and must give
// everything back.
static void test_destroyed_stream() {
  size_t free0 = free_bytes();
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t bytes = 8 * MIB;
  void *p = nullptr;
  CHECK_OK(gpupool_malloc(&p, bytes, 0, s));
  spin_then_fill<<<64, 256, 0, s>>>(static_cast<uint32_t *>(p), bytes / 4, 6, 200LL * 1000 * 1000);
  CUDA_OK(cudaGetLastError());
  CHECK_OK(gpupool_free(p));
  CUDA_OK(cudaStreamDestroy(s));
  CHECK_OK(gpupool_empty_cache(0));
  cudaError_t e = cudaDeviceSynchronize();
  CHECK(e == cudaSuccess);
  CHECK(reserved() == 0);
  size_t free1 = free_bytes();
  CHECK(free1 == free0);
  printf("destroyed stream: empty_cache returned, the kernel finished (%s), reserved %lld, free memory %zu -> %zu\n",
         cudaGetErrorString(e), reserved(), free0, free1);
}

// A block of device 0 written by a kernel on device 1 and read back by one on device 0, and
// copied to device 1 with cudaMemcpyPeer. gpupool maps a page for its device and the peers
// enabled by gpupool_enable_peer_access (PyTorch's rule): the first round checks that device 1
// has no access to the block until gpupool_enable_peer_access(1, 0), then has it (no
// cudaDeviceEnablePeerAccess needed for mapped memory); the round is run again with
// cudaDeviceEnablePeerAccess both ways, on pages mapped after enabling it.
static void peers_round(bool enable) {
  if (enable) {
    for (int d = 0; d < 2; d++) {
      CUDA_OK(cudaSetDevice(d));
      cudaError_t e = cudaDeviceEnablePeerAccess(1 - d, 0);
      CHECK(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled);
      cudaGetLastError();
    }
  }
  const char *how = enable ? "peer access enabled" : "peer access not enabled";
  CUDA_OK(cudaSetDevice(0));
  const size_t bytes = 6 * MIB;
  void *p = nullptr;
  CHECK_OK(gpupool_malloc(&p, bytes, 0, nullptr));
  CUmemLocation where;
  memset(&where, 0, sizeof where);
  where.type = CU_MEM_LOCATION_TYPE_DEVICE;
  where.id = 1;
  unsigned long long flags = 0;
  CUresult r = CUDA_SUCCESS;
  if (!enable) {
    r = cuMemGetAccess(&flags, &where, (CUdeviceptr)p);
    CHECK(r == CUDA_SUCCESS && flags == CU_MEM_ACCESS_FLAGS_PROT_NONE);
    printf("peers: device 1's access to device 0's block before gpupool_enable_peer_access: %llu (cuMemGetAccess %d)\n",
           flags, (int)r);
    CHECK_OK(gpupool_enable_peer_access(1, 0));
  }
  r = cuMemGetAccess(&flags, &where, (CUdeviceptr)p);
  bool access = r == CUDA_SUCCESS && flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK(access);
  if (!access) {
    // A kernel on device 1 would fault and spoil the context for the tests after this one.
    printf("peers (%s): device 1 has no read-write access to the block (cuMemGetAccess %d, flags %llu)\n", how, (int)r,
           flags);
  } else {
    CUDA_OK(cudaSetDevice(1));
    launch_fill(p, bytes, 8, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaSetDevice(0));
    long long wrong0 = wrong_words_on_device(p, bytes, 8);
    CHECK(wrong0 == 0);
    CUDA_OK(cudaSetDevice(1));
    void *q = nullptr;
    CUDA_OK(cudaMalloc(&q, bytes));
    CUDA_OK(cudaMemcpyPeer(q, 1, p, 0, bytes));
    long long wrong1 = wrong_words_on_device(q, bytes, 8);
    CHECK(wrong1 == 0);
    CUDA_OK(cudaFree(q));
    CUDA_OK(cudaSetDevice(0));
    printf("peers (%s): device 1 wrote device 0's block, device 0 read %lld words wrong, the peer copy %lld\n", how,
           wrong0, wrong1);
  }
  CHECK_OK(gpupool_free(p));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK_OK(gpupool_empty_cache(0));
  if (enable) {
    for (int d = 0; d < 2; d++) {
      CUDA_OK(cudaSetDevice(d));
      CUDA_OK(cudaDeviceDisablePeerAccess(1 - d));
    }
    CUDA_OK(cudaSetDevice(0));
  }
}

static void test_peers() {
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  if (count < 2) {
    printf("peers: skipped: one device\n");
    return;
  }
  int can10 = 0, can01 = 0;
  CUDA_OK(cudaDeviceCanAccessPeer(&can10, 1, 0));
  CUDA_OK(cudaDeviceCanAccessPeer(&can01, 0, 1));
  if (!can10 || !can01) {
    printf("peers: skipped: devices 0 and 1 cannot access each other\n");
    return;
  }
  CUDA_OK(cudaSetDevice(1));
  load_kernels();
  CUDA_OK(cudaSetDevice(0));
  peers_round(false);
  peers_round(true);
}

int main() {
  // Before anything else of gpupool: the configuration is fixed at the first allocation.
  CHECK_OK(gpupool_set_config("expandable_segments:True"));
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // the primary context, before measuring free memory
  load_kernels();
  size_t free_start = free_bytes();

  std::string conf = config_text();
  printf("configuration: %s\n", conf.c_str());
  CHECK(squeezed(conf).find("expandable_segments:true") != std::string::npos);
  void *p = nullptr;
  CHECK_OK(gpupool_malloc(&p, 512, 0, nullptr));
  CHECK_OK(gpupool_free(p));
  CHECK(gpupool_set_config("expandable_segments:False") != GPUPOOL_SUCCESS);
  printf("configuration after the first allocation: %s\n", gpupool_last_error_message());
  CHECK(config_text() == conf);
  CHECK_OK(gpupool_empty_cache(0));

  long long page = test_growth();
  if (page > 0) test_out_of_memory(page);
  test_peers();
  test_destroyed_stream();

  CHECK_OK(gpupool_empty_cache(-1));
  int count = 0;
  CHECK_OK(gpupool_device_count(&count));
  for (int d = 0; d < count; d++) CHECK(reserved(d) == 0);
  size_t free_end = free_bytes();
  long long diff = (long long)free_start - (long long)free_end;
  // Contexts and peer mappings made on the way may keep a little of device 0's memory.
  CHECK(diff <= (long long)(8 * MIB));
  printf("given back: free memory %zu MiB at start, %zu MiB at the end (difference %lld bytes)\n", free_start >> 20,
         free_end >> 20, diff);
  return checks_report("test_expandable");
}
