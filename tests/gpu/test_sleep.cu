// GPU tests of sleep and wake (gpupool_sleep, gpupool_wake) with GPUPOOL_DRIVER=cuda, in the
// default configuration (expandable segments):
// - the default pools, offload: free device memory (cudaMemGetInfo) rises by the pools'
//   reserved bytes to the byte, allocations are refused, and wake gives the memory back to the
//   byte with every word restored at the same addresses, the work queued before the sleep (a
//   kernel still spinning on the block's stream, and one on another stream named by
//   gpupool_record_stream) finished first;
// - discard: the addresses work again after wake;
// - a sleepable private pool holding a CUDA graph's buffers (captured once), offloaded and
//   woken, then the graph replayed without capturing again: its output bit for bit;
// - a wake without memory (cudaMalloc took it) fails with GPUPOOL_ERROR_OUT_OF_MEMORY, the
//   pool still asleep, and succeeds once the memory is back, contents intact;
// - the benchmark: offload (sleep) and restore (wake) of 1, 4, 16 and 40 GiB in blocks of
//   1 MiB to 1 GiB, in GB/s, against the pinned copy bandwidth of the same run
//   (cudaMemcpyAsync between device memory and cudaHostAlloc memory on two streams, each
//   direction): the issue's target is 80% of it (the last column, and the "bench:" line; a
//   figure below it is printed, not counted as a failed check). The host's resident memory
//   before the sleep, asleep and after the wake shows the host copy come and go (checked: back
//   within 1 GiB). Each row then times a sleep that discards and its wake (the virtual memory
//   calls alone: "unmap s", "map s") and three sleeps and wakes with
//   GPUPOOL_SLEEP_OFFLOAD_PINNED (the first pins the copy the pool keeps; the third is the
//   figure, its own "bench:" line), the checked blocks' words after each, and the resident
//   memory once gpupool_sleep_release_kept gave the copy back (checked likewise).
//   GPUPOOL_SLEEP_BENCH_GIB (say "1 4") picks the sizes; GPUPOOL_SLEEP_CHUNK,
//   _BUFFERS, _THREADS and _HUGE_PAGES tune the staging (docs/sleep.md).
// Built with nvcc against an installed gpupool; prints "N passed, M failed" and exits 1 on a
// failure. `test_sleep bench` runs the benchmark alone.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "gpupool.h"
#include "check.h"

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;
static const size_t GIB = size_t(1) << 30;
#include "measure.cuh"

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

// Spins for about `cycles` clock cycles, then fills: work still queued when the host sleeps
// the pool.
__global__ void spin_then_fill(uint32_t *p, size_t n, uint32_t tag, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = pattern(i, tag);
}

// out[i] = in[i] ^ tag: the "network" of the graph test.
__global__ void layer(const uint32_t *in, uint32_t *out, size_t n, uint32_t tag) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    out[i] = in[i] ^ tag;
}

static void launch_fill(void *p, size_t bytes, uint32_t tag, cudaStream_t s) {
  fill<<<256, 256, 0, s>>>(static_cast<uint32_t *>(p), bytes / 4, tag);
  CUDA_OK(cudaGetLastError());
}

// Words of [p, p + bytes) that differ from pattern(., tag), counted by a kernel (memory from
// cudaMalloc, not gpupool's, for the count).
static long long wrong_words(const void *p, size_t bytes, uint32_t tag) {
  unsigned long long *wrong = nullptr, host = 0;
  if (cudaMalloc((void **)&wrong, sizeof *wrong) != cudaSuccess) return -1;
  CUDA_OK(cudaMemset(wrong, 0, sizeof *wrong));
  count_wrong<<<256, 256>>>(static_cast<const uint32_t *>(p), bytes / 4, tag, wrong);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpy(&host, wrong, sizeof host, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(wrong));
  return (long long)host;
}

static gpupool_stats_t stats() {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s;
}

static long long free_bytes() {
  size_t free = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free, &total));
  return (long long)free;
}

static void test_default_pools_offload() {
  cudaStream_t s = nullptr, other = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  const size_t sizes[] = {256 * MIB, 3 * MIB + 512, 64 * MIB, 4096};
  std::vector<void *> blocks;
  for (size_t i = 0; i < 4; i++) {
    void *p = nullptr;
    CHECK_OK(gpupool_malloc(&p, sizes[i], 0, s));
    launch_fill(p, sizes[i], (uint32_t)i, s);
    blocks.push_back(p);
  }
  // Work still running when the pool goes to sleep: on the block's stream, and on another
  // stream named by record_stream. Sleep must wait for both (by events), then copy.
  spin_then_fill<<<64, 256, 0, s>>>(static_cast<uint32_t *>(blocks[1]), sizes[1] / 4, 77, 200000000LL);
  CUDA_OK(cudaGetLastError());
  CHECK_OK(gpupool_record_stream(blocks[2], other));
  spin_then_fill<<<64, 256, 0, other>>>(static_cast<uint32_t *>(blocks[2]), sizes[2] / 4, 78, 200000000LL);
  CUDA_OK(cudaGetLastError());
  void *cached = nullptr;
  CHECK_OK(gpupool_malloc(&cached, 100 * MIB, 0, s));
  CHECK_OK(gpupool_free(cached));
  long long reserved = stats().reserved_bytes.all.current;
  long long free0 = free_bytes();
  auto t = std::chrono::steady_clock::now();
  CHECK_OK(gpupool_sleep(0, 0, GPUPOOL_SLEEP_OFFLOAD));
  double slept = seconds_since(t);
  long long free1 = free_bytes();
  printf("default pools, offload: reserved %lld bytes; free memory rose by %lld bytes (sleep %.1f ms)\n", reserved,
         free1 - free0, slept * 1e3);
  CHECK(free1 - free0 == reserved);
  CHECK(stats().sleeping_bytes.current == reserved);
  void *refused = nullptr;
  CHECK(gpupool_malloc(&refused, 512, 0, s) == GPUPOOL_ERROR_INVALID_VALUE);
  t = std::chrono::steady_clock::now();
  CHECK_OK(gpupool_wake(0, 0));
  double woke = seconds_since(t);
  long long free2 = free_bytes();
  printf("default pools, wake: free memory fell by %lld bytes (wake %.1f ms)\n", free1 - free2, woke * 1e3);
  CHECK(free2 == free0);
  const uint32_t tags[] = {0, 77, 78, 3};
  for (size_t i = 0; i < 4; i++) {
    long long wrong = wrong_words(blocks[i], sizes[i], tags[i]);
    printf("  block %zu (%zu bytes): %lld words differ after wake\n", i, sizes[i], wrong);
    CHECK(wrong == 0);
  }
  // Discard: the addresses work again after wake.
  CHECK_OK(gpupool_sleep(0, 0, GPUPOOL_SLEEP_DISCARD));
  CHECK_OK(gpupool_wake(0, 0));
  launch_fill(blocks[0], sizes[0], 9, s);
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(wrong_words(blocks[0], sizes[0], 9) == 0);
  for (void *p : blocks) CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_empty_cache(0));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaStreamDestroy(other));
}

static void test_graph_in_a_sleepable_pool() {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool));
  const size_t n = 32 * MIB;
  void *weights = nullptr, *in = nullptr, *out = nullptr;
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, s));
  CHECK_OK(gpupool_malloc(&weights, n, 0, s));
  CHECK_OK(gpupool_malloc(&in, n, 0, s));
  launch_fill(weights, n, 5, s);
  launch_fill(in, n, 6, s);
  CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  void *scratch = nullptr;
  CHECK_OK(gpupool_malloc(&scratch, n, 0, s));  // allocated and freed inside the capture
  layer<<<256, 256, 0, s>>>(static_cast<uint32_t *>(in), static_cast<uint32_t *>(scratch), n / 4, 0x1234);
  CHECK_OK(gpupool_malloc(&out, n, 0, s));
  layer<<<256, 256, 0, s>>>(static_cast<uint32_t *>(scratch), static_cast<uint32_t *>(out), n / 4, 0x1234 ^ 6 ^ 8);
  CHECK_OK(gpupool_free(scratch));
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  // out = in ^ 0x1234 ^ 0x1234 ^ 6 ^ 8 = pattern(., 8).
  CHECK(wrong_words(out, n, 8) == 0);
  gpupool_stats_t ps = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_pool_stats(0, pool, &ps));
  long long reserved = ps.reserved_bytes.all.current, free0 = free_bytes();
  CHECK_OK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD));
  long long free1 = free_bytes();
  printf("graph pool: reserved %lld bytes; free memory rose by %lld bytes\n", reserved, free1 - free0);
  CHECK(free1 - free0 == reserved);
  CHECK_OK(gpupool_wake(0, pool));
  CHECK(free_bytes() == free0);
  CHECK(wrong_words(weights, n, 5) == 0 && wrong_words(in, n, 6) == 0);
  // Replayed without capturing again: the scratch the graph writes is mapped again too.
  CUDA_OK(cudaMemsetAsync(out, 0, n, s));
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  long long wrong = wrong_words(out, n, 8);
  printf("graph replayed after wake: %lld words differ\n", wrong);
  CHECK(wrong == 0);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CHECK_OK(gpupool_free(weights));
  CHECK_OK(gpupool_free(in));
  CHECK_OK(gpupool_free(out));
  CHECK_OK(gpupool_release_pool(0, pool));
  CUDA_OK(cudaStreamDestroy(s));
}

static void test_wake_without_memory() {
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool));
  const size_t n = 2 * GIB;
  void *w = nullptr;
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
  CHECK_OK(gpupool_malloc(&w, n, 0, s));
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  launch_fill(w, n, 11, s);
  CHECK_OK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD));
  // Take all but 1 GiB of what is free, outside gpupool.
  long long room = free_bytes() - (long long)GIB;
  void *hog = nullptr;
  CUDA_OK(cudaMalloc(&hog, (size_t)room));
  gpupool_status st = gpupool_wake(0, pool);
  printf("wake with 1 GiB free for 2 GiB: %s (%s)\n", gpupool_status_string(st),
         st == GPUPOOL_SUCCESS ? "" : gpupool_last_error_message());
  CHECK(st == GPUPOOL_ERROR_OUT_OF_MEMORY);
  void *refused = nullptr;
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
  CHECK(gpupool_malloc(&refused, 512, 0, s) == GPUPOOL_ERROR_INVALID_VALUE);  // still asleep
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  CUDA_OK(cudaFree(hog));
  CHECK_OK(gpupool_wake(0, pool));
  CHECK(wrong_words(w, n, 11) == 0);
  CHECK_OK(gpupool_free(w));
  CHECK_OK(gpupool_release_pool(0, pool));
  CUDA_OK(cudaStreamDestroy(s));
}

// What a GPUPOOL_SLEEP_* variable says, for the header of the table.
static const char *env_or(const char *name, const char *unset) {
  const char *v = getenv(name);
  return v && *v ? v : unset;
}

// Each row: a sleepable pool of `g` GiB in blocks of `b` bytes, offloaded and woken twice (the
// first round pins the staging ring when empty_cache gave it back; the second is the figure),
// the first and last blocks checked word for word, the host's resident memory before the
// sleep, asleep and after the wake (the host copy is ordinary memory, unmapped at wake).
static void bench() {
  std::vector<size_t> gibs = {1, 4, 16, 40};
  if (const char *env = getenv("GPUPOOL_SLEEP_BENCH_GIB")) {
    gibs.clear();
    std::istringstream in(env);
    size_t g;
    while (in >> g) gibs.push_back(g);
  }
  double d2h = pinned_bandwidth(GIB, true), h2d = pinned_bandwidth(GIB, false);
  printf("pinned copy bandwidth this run: device to host %.1f GB/s, host to device %.1f GB/s\n", d2h, h2d);
  printf("staging: GPUPOOL_SLEEP_CHUNK=%s GPUPOOL_SLEEP_BUFFERS=%s GPUPOOL_SLEEP_THREADS=%s GPUPOOL_SLEEP_HUGE_PAGES=%s\n",
         env_or("GPUPOOL_SLEEP_CHUNK", "32MiB (default)"), env_or("GPUPOOL_SLEEP_BUFFERS", "4 (default)"),
         env_or("GPUPOOL_SLEEP_THREADS", "0 (default: cores, at most 16)"),
         env_or("GPUPOOL_SLEEP_HUGE_PAGES", "on (default)"));
  printf("%-5s %-10s %-7s %-11s %-10s %-10s %-9s %-9s %-8s %-8s %-10s %-10s %-10s %s\n", "GiB", "block", "blocks",
         "cold sleep", "sleep GB/s", "wake GB/s", "sleep/pin", "wake/pin", "unmap s", "map s", "RSS MiB", "asleep",
         "woken", "target 0.80");
  const size_t block_sizes[] = {MIB, 64 * MIB, GIB};
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int rows = 0, met = 0, pin_met = 0;
  for (size_t g : gibs) {
    for (size_t b : block_sizes) {
      size_t total = g * GIB, count = total / b;
      if (count > 50000) continue;
      uint64_t pool = 0;
      CHECK_OK(gpupool_pool_create_sleepable(&pool));
      CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
      std::vector<void *> blocks(count, nullptr);
      bool ok = true;
      for (auto &p : blocks) ok = ok && gpupool_malloc(&p, b, 0, s) == GPUPOOL_SUCCESS;
      CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
      if (!ok) {
        printf("%-5zu %-10zu: not enough device memory (%s)\n", g, b, gpupool_last_error_message());
        for (void *p : blocks) gpupool_free(p);
        gpupool_release_pool(0, pool);
        gpupool_empty_cache(0);
        continue;
      }
      // The first and the last block (one and the same for a single block) checked after wake.
      launch_fill(blocks[0], b, 21, s);
      if (count > 1) launch_fill(blocks[count - 1], b, 22, s);
      CUDA_OK(cudaStreamSynchronize(s));
      double cold = 0, sleep_s = 0, wake_s = 0;
      long long rss[3] = {0, 0, 0};
      for (int round = 0; round < 2; round++) {
        rss[0] = rss_mib();
        auto t = std::chrono::steady_clock::now();
        gpupool_status st = gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD);
        sleep_s = seconds_since(t);
        CHECK(st == GPUPOOL_SUCCESS);
        if (st != GPUPOOL_SUCCESS) printf("sleep: %s\n", gpupool_last_error_message());
        rss[1] = rss_mib();
        t = std::chrono::steady_clock::now();
        CHECK_OK(gpupool_wake(0, pool));
        wake_s = seconds_since(t);
        rss[2] = rss_mib();
        if (round == 0) cold = (double)total / sleep_s / 1e9;
        CHECK(wrong_words(blocks[0], b, 21) == 0);
        if (count > 1) CHECK(wrong_words(blocks[count - 1], b, 22) == 0);
      }
      // The pages alone: a sleep that discards (no copy: the unmapping and release of the
      // pages) and the wake after it (creating and mapping them again), to tell the copies'
      // share of the times above from the virtual memory calls'.
      auto t = std::chrono::steady_clock::now();
      CHECK_OK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_DISCARD));
      double unmap_s = seconds_since(t);
      t = std::chrono::steady_clock::now();
      CHECK_OK(gpupool_wake(0, pool));
      double map_s = seconds_since(t);
      // The discard dropped the contents: the checked blocks are filled again.
      launch_fill(blocks[0], b, 21, s);
      if (count > 1) launch_fill(blocks[count - 1], b, 22, s);
      CUDA_OK(cudaStreamSynchronize(s));
      // GPUPOOL_SLEEP_OFFLOAD_PINNED: the first sleep pins the copy the pool keeps; the third
      // sleep and wake are the figures (copies straight between the device and the copy).
      double pin_cold = 0, pin_sleep_s = 0, pin_wake_s = 0;
      size_t kept = 0;
      for (int round = 0; round < 3; round++) {
        t = std::chrono::steady_clock::now();
        gpupool_status st = gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED);
        pin_sleep_s = seconds_since(t);
        CHECK(st == GPUPOOL_SUCCESS);
        if (st != GPUPOOL_SUCCESS) printf("pinned sleep: %s\n", gpupool_last_error_message());
        if (round == 0) pin_cold = (double)total / pin_sleep_s / 1e9;
        t = std::chrono::steady_clock::now();
        CHECK_OK(gpupool_wake(0, pool));
        pin_wake_s = seconds_since(t);
        CHECK(wrong_words(blocks[0], b, 21) == 0);
        if (count > 1) CHECK(wrong_words(blocks[count - 1], b, 22) == 0);
      }
      CHECK_OK(gpupool_sleep_host_bytes(0, nullptr, &kept));
      CHECK(kept >= total);
      long long rss_kept = rss_mib();
      size_t released = 0;
      CHECK_OK(gpupool_sleep_release_kept(0, pool, &released));
      CHECK(released == kept);
      long long rss_released = rss_mib();
      double sg = (double)total / sleep_s / 1e9, wg = (double)total / wake_s / 1e9;
      bool good = sg >= 0.8 * d2h && wg >= 0.8 * h2d;
      double psg = (double)total / pin_sleep_s / 1e9, pwg = (double)total / pin_wake_s / 1e9;
      bool pin_good = psg >= 0.8 * d2h && pwg >= 0.8 * h2d;
      rows++;
      met += good;
      pin_met += pin_good;
      printf("%-5zu %-10zu %-7zu %-11.1f %-10.1f %-10.1f %-9.2f %-9.2f %-8.3f %-8.3f %-10lld %-10lld %-10lld %s\n", g, b,
             count, cold, sg, wg, sg / d2h, wg / h2d, unmap_s, map_s, rss[0], rss[1], rss[2], good ? "PASS" : "FAIL");
      printf("      pinned (GPUPOOL_SLEEP_OFFLOAD_PINNED): first sleep %.1f GB/s; then sleep %.1f GB/s, wake %.1f GB/s, "
             "%.2f / %.2f of pinned; RSS kept %lld MiB, released %lld MiB: %s\n",
             pin_cold, psg, pwg, psg / d2h, pwg / h2d, rss_kept, rss_released, pin_good ? "PASS" : "FAIL");
      // The host copy goes back at wake: resident memory after it within 1 GiB of before.
      CHECK(rss[2] - rss[0] < 1024);
      CHECK(rss_released - rss[0] < 1024);
      for (void *p : blocks) CHECK_OK(gpupool_free(p));
      CHECK_OK(gpupool_release_pool(0, pool));
      CHECK_OK(gpupool_empty_cache(0));
    }
  }
  printf("bench: %d of %d rows at 80%% of the pinned bandwidth both ways (sleep and wake): %s\n", met, rows,
         met == rows ? "PASS" : "FAIL");
  printf("bench: with GPUPOOL_SLEEP_OFFLOAD_PINNED, %d of %d rows at 80%% both ways: %s\n", pin_met, rows,
         pin_met == rows ? "PASS" : "FAIL");
  CUDA_OK(cudaStreamDestroy(s));
}

// `test_sleep bench`: the benchmark only (scripts/gpu.sh's sleep_tune section).
int main(int argc, char **argv) {
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));  // the primary context, before measuring free memory
  if (argc > 1 && std::string(argv[1]) == "bench") {
    bench();
    return checks_report("test_sleep bench");
  }
  void *warm = nullptr;
  CUDA_OK(cudaMalloc(&warm, 4096));
  launch_fill(warm, 4096, 0, nullptr);
  spin_then_fill<<<1, 1>>>(static_cast<uint32_t *>(warm), 1, 0, 0);
  layer<<<1, 1>>>(static_cast<uint32_t *>(warm), static_cast<uint32_t *>(warm), 1, 0);
  CHECK(wrong_words(warm, 4, 0) >= 0);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(warm));
  test_default_pools_offload();
  test_graph_in_a_sleepable_pool();
  test_wake_without_memory();
  bench();
  return checks_report("test_sleep");
}
