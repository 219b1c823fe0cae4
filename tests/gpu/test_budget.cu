// Per-pool budgets (gpupool_pool_set_limit, issue 43) on the real driver, under load: a tenant
// pool over its limit in a loop on one thread while another pool allocates and frees at full
// speed on its own stream and thread, and a third thread changes the tenant's limit. The other
// pool is never refused; every refusal of the tenant is GPUPOOL_ERROR_OUT_OF_MEMORY, counted
// once in the device's num_ooms, its message naming the limit; the tenant's reserved bytes never
// pass the highest limit it had; everything goes back to the driver at the end. Host code only
// (no kernel). Prints "test_budget: N passed, M failed".
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>

#include "gpupool.h"
#include "check.h"

static const std::size_t MiB = std::size_t(1) << 20;

static std::int64_t pool_reserved(std::uint64_t pool) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  if (gpupool_pool_stats(0, pool, &s) != GPUPOOL_SUCCESS) return -1;
  return s.reserved_bytes.all.current;
}

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
    std::printf("test_budget: skipped: no GPU\n");
    return 77;
  }
  cudaSetDevice(0);
  cudaStream_t tenant_stream, other_stream;
  cudaStreamCreateWithFlags(&tenant_stream, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&other_stream, cudaStreamNonBlocking);
  std::uint64_t tenant = 0, other = 0;
  CHECK_OK(gpupool_pool_create(&tenant));
  CHECK_OK(gpupool_pool_create(&other));
  CHECK_OK(gpupool_pool_set_limit(0, tenant, 64 * MiB));
  gpupool_stats_t before = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &before));

  std::atomic<long> served{0}, refused{0}, wrong_status{0}, over_limit{0}, other_refused{0}, other_ops{0};
  std::atomic<bool> message_named_limit{false}, toggling{false}, done{false};

  // The tenant: 40 MiB, then 40 MiB more (80 MiB: past a limit of 64 MiB, within 128 MiB).
  std::thread t1([&] {
    cudaSetDevice(0);
    if (gpupool_begin_allocate_to_pool_thread(0, tenant) != GPUPOOL_SUCCESS) {
      wrong_status++;
      return;
    }
    for (int i = 0; i < 3000; i++) {
      if (i == 500) toggling = true;  // the first 500 rounds under 64 MiB alone
      void *a = nullptr, *b = nullptr;
      for (void **p : {&a, &b}) {
        gpupool_status s = gpupool_malloc(p, 40 * MiB, 0, (gpupool_stream_t)tenant_stream);
        if (s == GPUPOOL_SUCCESS) {
          served++;
        } else if (s == GPUPOOL_ERROR_OUT_OF_MEMORY) {
          refused++;
          if (!toggling && std::strstr(gpupool_last_error_message(), "limited to 64.00 MiB") != nullptr)
            message_named_limit = true;
        } else {
          wrong_status++;
        }
      }
      if (pool_reserved(tenant) > std::int64_t(128 * MiB)) over_limit++;
      if (b != nullptr) gpupool_free(b);
      if (a != nullptr) gpupool_free(a);
    }
    gpupool_end_allocate_to_pool(0, tenant);
    done = true;
  });
  // The other tenant: 1 to 32 MiB at full speed, never limited.
  std::thread t2([&] {
    cudaSetDevice(0);
    if (gpupool_begin_allocate_to_pool_thread(0, other) != GPUPOOL_SUCCESS) {
      other_refused++;
      return;
    }
    std::uint64_t x = 88172645463325252ull;
    void *live[8] = {nullptr};
    for (long i = 0; !done || i < 20000; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      int k = int(i % 8);
      if (live[k] != nullptr) gpupool_free(live[k]);
      live[k] = nullptr;
      if (gpupool_malloc(&live[k], (1 + x % 32) * MiB, 0, (gpupool_stream_t)other_stream) != GPUPOOL_SUCCESS)
        other_refused++;
      other_ops++;
    }
    for (void *p : live)
      if (p != nullptr) gpupool_free(p);
    gpupool_end_allocate_to_pool(0, other);
  });
  // The limit changed while both allocate: 64 and 128 MiB in turn, 64 MiB at the end.
  std::thread t3([&] {
    while (!toggling && !done) std::this_thread::sleep_for(std::chrono::microseconds(100));
    for (int i = 0; !done; i++) {
      gpupool_pool_set_limit(0, tenant, (i % 2 ? 128 : 64) * MiB);
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    gpupool_pool_set_limit(0, tenant, 64 * MiB);
  });
  t1.join();
  t2.join();
  t3.join();

  gpupool_stats_t after = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &after));
  std::printf("tenant: %ld served, %ld refused; other: %ld operations, %ld refused; num_ooms %lld -> %lld\n",
              served.load(), refused.load(), other_ops.load(), other_refused.load(), (long long)before.num_ooms,
              (long long)after.num_ooms);
  CHECK(other_refused == 0);
  CHECK(wrong_status == 0);
  CHECK(refused > 0 && served > 0);
  CHECK(message_named_limit);
  CHECK(over_limit == 0);
  CHECK(after.num_ooms - before.num_ooms == refused);
  gpupool_stats_t ts = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_pool_stats(0, tenant, &ts));
  CHECK(ts.pool_limit == std::int64_t(64 * MiB));
  CHECK(ts.allocated_bytes.all.current == 0);
  CHECK_OK(gpupool_release_pool(0, tenant));
  CHECK_OK(gpupool_release_pool(0, other));
  CHECK_OK(gpupool_empty_cache(0));
  gpupool_stats_t end = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &end));
  CHECK(end.reserved_bytes.all.current == 0);
  cudaStreamDestroy(tenant_stream);
  cudaStreamDestroy(other_stream);
  return checks_report("test_budget");
}
