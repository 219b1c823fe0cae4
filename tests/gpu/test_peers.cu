// GPU test of peer access as PyTorch grants it (issue 42; gpupool_enable_peer_access), with
// GPUPOOL_DRIVER=cuda and expandable segments, kernel-free, on 2 GPUs or more (skipped on one):
// - a block of device 0 is mapped for device 0 alone: cuMemGetAccess for device 1 reads no
//   access; after gpupool_enable_peer_access(1, 0) it reads read-write, for that block (mapped
//   before) and for one mapped after; device 1 then copies the block with cudaMemcpyPeer and
//   with cudaMemcpy on its own stream, bit for bit; device 0's access to device 1's memory is
//   still none (one way only);
// - the cost of mapping: a sleepable pool of GPUPOOL_PEERS_GIB GiB (default 4) in blocks of
//   64 MiB on device 0, slept with discard and woken (the unmapping and the mapping of its
//   pages alone, as the sleep benchmark's "unmap s" and "map s"), with no peer, then with device
//   1 enabled, then with every other device enabled; the seconds per page of each.
// Built with nvcc against an installed gpupool; prints "N passed, M failed" and exits 1 on a
// failure.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gpupool.h"
#include "check.h"

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;
static const size_t GIB = size_t(1) << 30;
#include "measure.cuh"

// The access flags of device `dev` to the mapping at `p` (cuMemGetAccess), -1 when it fails.
static long long access_of(const void *p, int dev) {
  CUmemLocation where;
  memset(&where, 0, sizeof where);
  where.type = CU_MEM_LOCATION_TYPE_DEVICE;
  where.id = dev;
  unsigned long long flags = 0;
  if (cuMemGetAccess(&flags, &where, (CUdeviceptr)p) != CUDA_SUCCESS) return -1;
  return (long long)flags;
}

static std::vector<uint32_t> pattern(size_t bytes, uint32_t tag) {
  std::vector<uint32_t> v(bytes / 4);
  for (size_t i = 0; i < v.size(); i++) v[i] = (uint32_t)(i * 2654435761u) ^ tag;
  return v;
}

static void test_access() {
  const size_t bytes = 6 * MIB;
  CUDA_OK(cudaSetDevice(0));
  void *p = nullptr, *mine1 = nullptr;
  CHECK_OK(gpupool_malloc(&p, bytes, 0, nullptr));
  std::vector<uint32_t> want = pattern(bytes, 7);
  CUDA_OK(cudaMemcpy(p, want.data(), bytes, cudaMemcpyHostToDevice));
  long long before = access_of(p, 1), own = access_of(p, 0);
  CHECK(own == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  CHECK(before == CU_MEM_ACCESS_FLAGS_PROT_NONE);
  CHECK_OK(gpupool_enable_peer_access(1, 0));
  long long after = access_of(p, 1);
  CHECK(after == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  void *later = nullptr;
  CHECK_OK(gpupool_malloc(&later, 30 * MIB, 0, nullptr));
  long long later_access = access_of(later, 1);
  CHECK(later_access == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  // One way: device 1's own memory is not mapped for device 0.
  CHECK_OK(gpupool_malloc(&mine1, bytes, 1, nullptr));
  long long back = access_of(mine1, 0);
  CHECK(back == CU_MEM_ACCESS_FLAGS_PROT_NONE);
  // Device 1 copies device 0's block: with cudaMemcpyPeer and with a plain copy on its stream.
  CUDA_OK(cudaSetDevice(1));
  void *q = nullptr;
  CUDA_OK(cudaMalloc(&q, 2 * bytes));
  CUDA_OK(cudaMemcpyPeer(q, 1, p, 0, bytes));
  CUDA_OK(cudaMemcpy(static_cast<char *>(q) + bytes, p, bytes, cudaMemcpyDeviceToDevice));
  std::vector<uint32_t> got(2 * bytes / 4);
  CUDA_OK(cudaMemcpy(got.data(), q, 2 * bytes, cudaMemcpyDeviceToHost));
  bool peer_copy = std::equal(want.begin(), want.end(), got.begin());
  bool plain_copy = std::equal(want.begin(), want.end(), got.begin() + want.size());
  CHECK(peer_copy && plain_copy);
  CUDA_OK(cudaFree(q));
  CUDA_OK(cudaSetDevice(0));
  printf("access: device 1 to device 0's block before gpupool_enable_peer_access %lld, after %lld, a block mapped "
         "after %lld; device 0 to device 1's %lld (%d: none, %d: read-write); device 1 copied it bit for bit: "
         "cudaMemcpyPeer %s, cudaMemcpy %s\n",
         before, after, later_access, back, (int)CU_MEM_ACCESS_FLAGS_PROT_NONE,
         (int)CU_MEM_ACCESS_FLAGS_PROT_READWRITE, peer_copy ? "yes" : "no", plain_copy ? "yes" : "no");
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_free(later));
  CHECK_OK(gpupool_free(mine1));
  CUDA_OK(cudaDeviceSynchronize());
  CHECK_OK(gpupool_empty_cache(-1));
  CHECK_OK(gpupool_empty_cache(1));
}

// A pool of `gib` GiB on device 0 slept with discard and woken: (unmap s, map s, pages).
static void map_cost(size_t gib, const char *peers) {
  const size_t b = 64 * MIB, count = gib * GIB / b;
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool));
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
  std::vector<void *> blocks(count, nullptr);
  bool ok = true;
  for (auto &p : blocks) ok = ok && gpupool_malloc(&p, b, 0, nullptr) == GPUPOOL_SUCCESS;
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  CHECK(ok);
  if (ok) {
    gpupool_stats_t st = GPUPOOL_STATS_INIT;
    CHECK_OK(gpupool_pool_stats(0, pool, &st));
    double pages = (double)st.reserved_bytes.all.current / (20.0 * MIB);
    double best_unmap = 1e9, best_map = 1e9;
    for (int round = 0; round < 3; round++) {
      auto t = std::chrono::steady_clock::now();
      CHECK_OK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_DISCARD));
      double u = seconds_since(t);
      t = std::chrono::steady_clock::now();
      CHECK_OK(gpupool_wake(0, pool));
      double m = seconds_since(t);
      best_unmap = u < best_unmap ? u : best_unmap;
      best_map = m < best_map ? m : best_map;
    }
    printf("%-28s %-6zu %-8.0f %-10.4f %-10.4f %-14.1f %-14.1f\n", peers, gib, pages, best_unmap, best_map,
           best_unmap / pages * 1e6, best_map / pages * 1e6);
  }
  for (void *p : blocks)
    if (p) CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK_OK(gpupool_empty_cache(0));
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    printf("test_peers: skipped: fewer than two GPUs (%d)\n", devices);
    return 0;
  }
  int can = 0;
  CUDA_OK(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (!can) {
    printf("test_peers: skipped: device 1 cannot access device 0\n");
    return 0;
  }
  CHECK_OK(gpupool_set_config("expandable_segments:True"));
  for (int d = devices - 1; d >= 0; d--) {
    CUDA_OK(cudaSetDevice(d));
    CUDA_OK(cudaFree(nullptr));
  }
  size_t gib = 4;
  if (const char *env = getenv("GPUPOOL_PEERS_GIB")) gib = (size_t)atol(env);
  printf("%d GPUs; map cost of device 0's pages (a sleepable pool slept with discard and woken, best of 3):\n",
         devices);
  printf("%-28s %-6s %-8s %-10s %-10s %-14s %-14s\n", "peers enabled", "GiB", "pages", "unmap s", "map s",
         "unmap us/page", "map us/page");
  map_cost(gib, "none");
  test_access();
  map_cost(gib, "device 1");
  for (int d = 2; d < devices; d++) {
    int c = 0;
    CUDA_OK(cudaDeviceCanAccessPeer(&c, d, 0));
    if (c) CHECK_OK(gpupool_enable_peer_access(d, 0));
  }
  if (devices > 2) map_cost(gib, "every device");
  return checks_report("test_peers");
}
