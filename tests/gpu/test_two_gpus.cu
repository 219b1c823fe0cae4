// GPU test of sleep and wake on two GPUs at once (issue 26), with GPUPOOL_DRIVER=cuda in the
// default configuration (expandable segments): one thread per device, each with a sleepable
// private pool on its device holding blocks of 1 MiB to 256 MiB written with a pattern. Both
// threads sleep their pools at the same moment (offload), then wake them at the same moment;
// each checks, on its own device, that free device memory rose by the pool's reserved bytes to
// the byte, came back to the byte, and that every word was restored at the same addresses. A
// second round discards instead, and checks that the addresses work again after wake. Three
// rounds of each. Before them, on one thread: a page of device 0 moved between streams by the
// high-water rule, then written by a kernel on device 1 (enabled as device 0's peer).
//
// The checks are counted on the main thread from what each thread measured (check.h's counters
// are not thread-safe). Prints "skipped: fewer than two GPUs" and passes on one GPU. Built with
// nvcc against an installed gpupool; prints "N passed, M failed" and exits 1 on a failure.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "gpupool.h"
#include "check.h"
#include "barrier.cuh"
// pattern, fill, and slow_check (with no spin: the words that differ from a pattern).
#include "readers.cuh"

// What one thread saw in one round; the main thread checks it.
struct Round {
  bool calls_ok = true;        // every gpupool and CUDA call succeeded
  long long reserved = -1;     // the pool's reserved bytes before the sleep
  long long rose = -2;         // free device memory after the sleep less before it
  long long back = -3;         // free device memory after the wake less before the sleep
  long long wrong = -1;        // words that differ after the wake (offload), or after a new fill (discard)
};

static long long free_bytes(bool *ok) {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) *ok = false;
  return (long long)free;
}

static long long wrong_words(const std::vector<void *> &blocks, const size_t *sizes, uint32_t tag, bool *ok) {
  unsigned long long *wrong = nullptr, host = 0;
  if (cudaMalloc((void **)&wrong, sizeof *wrong) != cudaSuccess) return *ok = false, -1;
  *ok &= cudaMemset(wrong, 0, sizeof *wrong) == cudaSuccess;
  for (size_t k = 0; k < blocks.size(); k++)
    slow_check<<<256, 256>>>(static_cast<const uint32_t *>(blocks[k]), sizes[k] / 4, tag + (uint32_t)k, 0, wrong);
  *ok &= cudaMemcpy(&host, wrong, sizeof host, cudaMemcpyDeviceToHost) == cudaSuccess;
  *ok &= cudaFree(wrong) == cudaSuccess;
  return (long long)host;
}

static const size_t kSizes[] = {1 * MIB, 3 * MIB + 512, 64 * MIB, 256 * MIB};
static const int kRounds = 3;

// One device's thread: its pool, then kRounds of offload and kRounds of discard.
static void run_device(int device, Barrier *barrier, std::vector<Round> *rounds) {
  bool ok = cudaSetDevice(device) == cudaSuccess;
  cudaStream_t s = nullptr;
  ok &= cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
  uint64_t pool = 0;
  ok &= gpupool_pool_create_sleepable(&pool) == GPUPOOL_SUCCESS;
  ok &= gpupool_begin_allocate_to_pool(device, pool, s) == GPUPOOL_SUCCESS;
  std::vector<void *> blocks;
  for (size_t size : kSizes) {
    void *p = nullptr;
    ok &= gpupool_malloc(&p, size, device, s) == GPUPOOL_SUCCESS;
    blocks.push_back(p);
  }
  ok &= gpupool_end_allocate_to_pool(device, pool) == GPUPOOL_SUCCESS;
  for (int r = 0; r < 2 * kRounds; r++) {
    Round out;
    bool offload = r < kRounds;
    uint32_t tag = (uint32_t)(device * 1000 + r * 10);
    for (size_t k = 0; k < blocks.size() && ok; k++)
      fill<<<256, 256, 0, s>>>(static_cast<uint32_t *>(blocks[k]), kSizes[k] / 4, tag + (uint32_t)k);
    ok &= cudaGetLastError() == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess;
    gpupool_stats_t ps = GPUPOOL_STATS_INIT;
    ok &= gpupool_pool_stats(device, pool, &ps) == GPUPOOL_SUCCESS;
    out.reserved = ps.reserved_bytes.all.current;
    long long before = free_bytes(&ok);
    barrier->wait();
    bool slept = gpupool_sleep(device, pool, offload ? GPUPOOL_SLEEP_OFFLOAD : GPUPOOL_SLEEP_DISCARD) == GPUPOOL_SUCCESS;
    if (!slept) std::fprintf(stderr, "device %d: gpupool_sleep: %s\n", device, gpupool_last_error_message());
    ok &= slept;
    out.rose = free_bytes(&ok) - before;
    barrier->wait();
    bool woke = gpupool_wake(device, pool) == GPUPOOL_SUCCESS;
    if (!woke) std::fprintf(stderr, "device %d: gpupool_wake: %s\n", device, gpupool_last_error_message());
    ok &= woke;
    out.back = free_bytes(&ok) - before;
    if (!offload) {
      // Discarded: the addresses work again; a new pattern reads back.
      tag += 5;
      for (size_t k = 0; k < blocks.size() && ok; k++)
        fill<<<256, 256, 0, s>>>(static_cast<uint32_t *>(blocks[k]), kSizes[k] / 4, tag + (uint32_t)k);
      ok &= cudaGetLastError() == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess;
    }
    out.wrong = wrong_words(blocks, kSizes, tag, &ok);
    out.calls_ok = ok;
    rounds->push_back(out);
  }
  for (void *p : blocks) ok &= gpupool_free(p) == GPUPOOL_SUCCESS;
  ok &= gpupool_release_pool(device, pool) == GPUPOOL_SUCCESS;
  ok &= cudaStreamDestroy(s) == cudaSuccess;
  rounds->back().calls_ok &= ok;
}

// A page moved between streams, then written from the peer: with GPUPOOL_EXPANDABLE_RECLAIM=1
// (main sets it before gpupool starts), a stream's growth past device 0's high-water mark maps
// the pages another stream's freed block had, unmapped for it, instead of creating pages
// (device 0's free memory does not move). A kernel on device 1 then writes the block on those
// pages, device 1 enabled as device 0's peer by gpupool_enable_peer_access (gpupool maps a
// page for its device and the peers enabled, PyTorch's rule; no cudaDeviceEnablePeerAccess is
// needed for mapped memory), and device 0 reads it back.
static void test_moved_page_from_the_peer() {
  const size_t bytes = 6 * MIB;
  CHECK(cudaSetDevice(0) == cudaSuccess);
  CHECK_OK(gpupool_enable_peer_access(1, 0));
  cudaStream_t s1 = nullptr, s2 = nullptr;
  CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess);
  CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == cudaSuccess);
  void *a = nullptr, *b = nullptr;
  CHECK_OK(gpupool_malloc(&a, bytes, 0, s1));
  fill<<<256, 256, 0, s1>>>(static_cast<uint32_t *>(a), bytes / 4, 1);
  CHECK(cudaStreamSynchronize(s1) == cudaSuccess);
  CHECK_OK(gpupool_free(a));
  bool ok = true;
  long long before = free_bytes(&ok);
  CHECK_OK(gpupool_malloc(&b, bytes, 0, s2));
  long long after = free_bytes(&ok);
  CHECK(ok);
  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &st));
  CHECK(cudaSetDevice(1) == cudaSuccess);
  fill<<<256, 256>>>(static_cast<uint32_t *>(b), bytes / 4, 77);
  cudaError_t launched = cudaGetLastError();
  cudaError_t ran = cudaDeviceSynchronize();
  CHECK(cudaSetDevice(0) == cudaSuccess);
  std::vector<void *> blocks = {b};
  const size_t sizes[] = {bytes};
  long long wrong = (launched == cudaSuccess && ran == cudaSuccess) ? wrong_words(blocks, sizes, 77, &ok) : -1;
  std::printf("moved page: device 0's free memory moved by %lld bytes at the second stream's growth (reserved %lld); "
              "device 1 wrote the block (%s, %s), device 0 read %lld words wrong\n",
              after - before, (long long)st.reserved_bytes.all.current, cudaGetErrorString(launched),
              cudaGetErrorString(ran), wrong);
  CHECK(after == before);
  CHECK(st.reserved_bytes.all.current == (long long)bytes);
  CHECK(wrong == 0);
  CHECK_OK(gpupool_free(b));
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(cudaStreamDestroy(s1) == cudaSuccess && cudaStreamDestroy(s2) == cudaSuccess);
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    std::printf("test_two_gpus: skipped: fewer than two GPUs (%d)\n", devices);
    return 0;
  }
  // Before gpupool reads its configuration (at its first call).
  setenv("GPUPOOL_EXPANDABLE_RECLAIM", "1", 1);
  test_moved_page_from_the_peer();
  Barrier barrier(2);
  std::vector<Round> rounds[2];
  std::thread t0(run_device, 0, &barrier, &rounds[0]);
  std::thread t1(run_device, 1, &barrier, &rounds[1]);
  t0.join();
  t1.join();
  for (int d = 0; d < 2; d++) {
    CHECK(rounds[d].size() == 2 * kRounds);
    for (size_t r = 0; r < rounds[d].size(); r++) {
      const Round &x = rounds[d][r];
      std::printf("device %d, round %zu (%s): reserved %lld bytes; free memory rose by %lld at sleep, %lld after wake; "
                  "%lld words differ\n",
                  d, r, r < kRounds ? "offload" : "discard", x.reserved, x.rose, x.back, x.wrong);
      CHECK(x.calls_ok);
      CHECK(x.reserved > 0);
      CHECK(x.rose == x.reserved);
      CHECK(x.back == 0);
      CHECK(x.wrong == 0);
    }
  }
  return checks_report("test_two_gpus");
}
