// GPU measurement of a pool's first sleep in the pinned mode (GPUPOOL_SLEEP_OFFLOAD_PINNED),
// with and without gpupool_sleep_prepare (issue 42), GPUPOOL_DRIVER=cuda, kernel-free: a
// sleepable pool of G GiB (GPUPOOL_FIRST_SLEEP_GIB, default "4 16") in blocks of 64 MiB, its
// first and last blocks written with a pattern by cudaMemcpy; its first sleep timed, in GB/s,
// (a) as it comes (the sleep pins its host copy), (b) after gpupool_sleep_prepare (timed on its
// own: what the engine pays at start-up), then a second sleep (the copy kept) for reference;
// after each wake the blocks are read back by cudaMemcpy and compared. Also checks that the
// prepare's pinned bytes are what gpupool_sleep_host_bytes reports as kept, and that a sleep
// after prepare leaves the kept bytes where they were after the wake. The pinned copy bandwidth
// of the run (cudaMemcpyAsync from a device buffer to cudaHostAlloc memory) is printed beside.
// Prints "N passed, M failed" and exits 1 on a failure.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "gpupool.h"
#include "check.h"

#define CUDA_OK(call) CHECK((call) == cudaSuccess)
static const size_t MIB = size_t(1) << 20;
static const size_t GIB = size_t(1) << 30;
#include "measure.cuh"

static std::vector<uint32_t> pattern(size_t bytes, uint32_t tag) {
  std::vector<uint32_t> v(bytes / 4);
  for (size_t i = 0; i < v.size(); i++) v[i] = (uint32_t)(i * 2654435761u) ^ tag;
  return v;
}

// Whether `bytes` at the device address `p` hold pattern(tag), read back with cudaMemcpy.
static bool holds(const void *p, size_t bytes, uint32_t tag) {
  std::vector<uint32_t> back(bytes / 4), want = pattern(bytes, tag);
  if (cudaMemcpy(back.data(), p, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  return back == want;
}

// One row: a fresh pool of `g` GiB; its first pinned sleep timed with or without prepare, then
// a second. Prints the figures; returns false when the pool could not be made.
static bool row(size_t g, bool prepare) {
  const size_t b = 64 * MIB, count = g * GIB / b;
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool));
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
  std::vector<void *> blocks(count, nullptr);
  bool ok = true;
  for (auto &p : blocks) ok = ok && gpupool_malloc(&p, b, 0, nullptr) == GPUPOOL_SUCCESS;
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  if (ok) {
    std::vector<uint32_t> a = pattern(b, 31), z = pattern(b, 32);
    CUDA_OK(cudaMemcpy(blocks[0], a.data(), b, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(blocks[count - 1], z.data(), b, cudaMemcpyHostToDevice));
    double prep_s = 0;
    size_t pinned = 0, kept = 0;
    if (prepare) {
      auto t = std::chrono::steady_clock::now();
      CHECK_OK(gpupool_sleep_prepare(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED, &pinned));
      prep_s = seconds_since(t);
      CHECK_OK(gpupool_sleep_host_bytes(0, nullptr, &kept));
      CHECK(pinned >= g * GIB && kept == pinned);
    }
    double gbs[2] = {0, 0};
    for (int round = 0; round < 2; round++) {
      auto t = std::chrono::steady_clock::now();
      gpupool_status st = gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD_PINNED);
      gbs[round] = (double)(g * GIB) / seconds_since(t) / 1e9;
      CHECK(st == GPUPOOL_SUCCESS);
      CHECK_OK(gpupool_wake(0, pool));
      CHECK(holds(blocks[0], b, 31));
      CHECK(holds(blocks[count - 1], b, 32));
    }
    size_t after = 0;
    CHECK_OK(gpupool_sleep_host_bytes(0, nullptr, &after));
    if (prepare) CHECK(after == pinned);  // the sleep used the prepared copy, pinned nothing more
    printf("%-5zu %-8s %-12.3f %-16.1f %-16.1f\n", g, prepare ? "yes" : "no", prep_s, gbs[0], gbs[1]);
  } else {
    printf("%-5zu: not enough device memory (%s)\n", g, gpupool_last_error_message());
  }
  for (void *p : blocks)
    if (p) CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK_OK(gpupool_empty_cache(0));
  return ok;
}

int main() {
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));
  std::vector<size_t> gibs = {4, 16};
  if (const char *env = getenv("GPUPOOL_FIRST_SLEEP_GIB")) {
    gibs.clear();
    std::istringstream in(env);
    size_t g;
    while (in >> g) gibs.push_back(g);
  }
  printf("pinned copy bandwidth this run: device to host %.1f GB/s\n", pinned_bandwidth(GIB, true));
  printf("%-5s %-8s %-12s %-16s %-16s\n", "GiB", "prepare", "prepare s", "1st sleep GB/s", "2nd sleep GB/s");
  for (size_t g : gibs) {
    row(g, false);
    row(g, true);
  }
  return checks_report("test_first_sleep");
}
