/* Issue 40's fixes attacked through the C ABI, as an outsider would (the fourth round):
 * - pool ids nobody handed out (0, the sleepable bit alone, bit 63, 2^62 - 1, u64::MAX, the
 *   twins of real ids, ids one past the last) refused by every call that names a pool, while
 *   8 threads create 2,000 pools each, every one of which is accepted;
 * - gpupool_sim_inject_fault with NULL, an empty name, a name that is not UTF-8, a name with a
 *   prefix of a real one, every fault kind out of range, a huge skip (never fires, reported
 *   pending), and every name the simulator knows (each kind accepted, none fired, all reported pending);
 * - gpupool_largest_allocatable on two devices while threads sleep and wake a pool on each
 *   and free its blocks: 0 whenever device 0's default pools sleep, never more than the
 *   device.
 * Needs GPUPOOL_DRIVER=sim with two devices (skipped otherwise). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "gpupool_testing.h"
#include "check.h"

#define MIB ((size_t)1 << 20)
#define S ((gpupool_stream_t)0x10)
#define SLEEPABLE ((uint64_t)1 << 62)

/* Every call that names a private pool refuses `pool`. */
static void expect_refused(uint64_t pool) {
  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  size_t n = 0;
  CHECK(gpupool_begin_allocate_to_pool(0, pool, S) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_begin_allocate_to_pool_thread(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_end_allocate_to_pool(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_release_pool(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_pool_stats(0, pool, &st) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_wake(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sleep_release_kept(0, pool, &n) == GPUPOOL_ERROR_INVALID_VALUE);
}

#define THREADS 8
#define PER_THREAD 2000

static uint64_t made[THREADS][PER_THREAD];

static void *create_pools(void *arg) {
  uint64_t *out = arg;
  for (int i = 0; i < PER_THREAD; i++) {
    gpupool_status s = i % 2 ? gpupool_pool_create_sleepable(&out[i]) : gpupool_pool_create(&out[i]);
    if (s != GPUPOOL_SUCCESS) out[i] = 0;
  }
  return NULL;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

static void test_pool_ids(void) {
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, create_pools, made[i]);
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  static uint64_t all[THREADS * PER_THREAD];
  memcpy(all, made, sizeof all);
  qsort(all, THREADS * PER_THREAD, sizeof all[0], cmp_u64);
  int distinct = 1, sleepable = 0;
  uint64_t top = 0;
  for (int i = 0; i < THREADS * PER_THREAD; i++) {
    CHECK(all[i] != 0);
    if (i > 0 && all[i] == all[i - 1]) distinct = 0;
    sleepable += (all[i] & SLEEPABLE) != 0;
    if ((all[i] & ~SLEEPABLE) > top) top = all[i] & ~SLEEPABLE;
  }
  CHECK(distinct);
  CHECK(sleepable == THREADS * PER_THREAD / 2);
  /* A sample of them is accepted by a call that names a pool (stats: changes nothing). */
  for (int i = 0; i < THREADS * PER_THREAD; i += 97) {
    gpupool_stats_t st = GPUPOOL_STATS_INIT;
    CHECK_OK(gpupool_pool_stats(0, all[i], &st));
  }
  /* Ids nobody handed out. */
  const uint64_t forged[] = {SLEEPABLE,       (uint64_t)1 << 63,  SLEEPABLE | ((uint64_t)1 << 63),
                             SLEEPABLE - 1,   UINT64_MAX,         UINT64_MAX - 1,
                             top + 1,         (top + 1) | SLEEPABLE, top + 1000000,
                             0x7fffffffffffffffULL};
  for (size_t i = 0; i < sizeof forged / sizeof forged[0]; i++) expect_refused(forged[i]);
  /* The twin of each kind, and bit 63 over a real id. */
  for (int i = 0; i < 64; i++) {
    uint64_t p = made[i % THREADS][i];
    uint64_t twin = p ^ SLEEPABLE;
    int twin_made = 0;
    for (int k = 0; k < THREADS * PER_THREAD && !twin_made; k++) twin_made = all[k] == twin;
    if (!twin_made) expect_refused(twin);
    expect_refused(p | ((uint64_t)1 << 63));
  }
  /* Pool 0 is the default pools: never a private pool. */
  CHECK(gpupool_begin_allocate_to_pool(0, 0, S) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_release_pool(0, 0) == GPUPOOL_ERROR_INVALID_VALUE);
}

static void test_inject_arguments(void) {
  /* Every name the simulated device answers to (SimOp::symbol). */
  const char *names[] = {
      "cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuEventCreate", "cuEventRecord",
      "cuEventQuery", "cuEventSynchronize", "cuEventDestroy_v2", "cuCtxSynchronize",
      "cuCtxGetCurrent", "cuDevicePrimaryCtxRetain", "cuMemGetAllocationGranularity",
      "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap",
      "cuMemSetAccess", "cuMemUnmap", "cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister_v2",
      "cuMemHostUnregister", "cuStreamGetCtx", "cuStreamGetCaptureInfo_v2",
      "cuThreadExchangeStreamCaptureMode", "cuStreamCreate", "cuStreamDestroy_v2",
      "cuStreamSynchronize", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2", "mmap", "munmap",
      "cuDeviceGetUuid_v2", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
      "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle",
      "cuMemGetHandleForAddressRange",
  };
  size_t pending = 0;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    for (uint32_t fault = 0; fault <= 3; fault++) CHECK_OK(gpupool_sim_inject_fault(names[i], UINT32_MAX, fault));
  }
  CHECK_OK(gpupool_sim_clear_faults(&pending));
  CHECK(pending == 4 * sizeof names / sizeof names[0]);
  const char bad_utf8[] = {(char)0xff, (char)0xfe, 'c', 'u', (char)0xc3, 0};
  const char *bad[] = {"", bad_utf8, "cuMem", "cuMemMapX", "CUMEMMAP", " cuMemMap", "cuMemMap ", "mmap\n"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK(gpupool_sim_inject_fault(bad[i], 0, GPUPOOL_SIM_FAULT_ERROR) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(strlen(gpupool_last_error_message()) > 0);
  }
  CHECK(gpupool_sim_inject_fault(NULL, UINT32_MAX, UINT32_MAX) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sim_inject_fault("cuMemMap", 0, 4) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sim_inject_fault("cuMemMap", 0, 0x80000000u) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_sim_clear_faults(&pending));
  CHECK(pending == 0);
  /* A huge skip never fires: a malloc that grows goes through. */
  CHECK_OK(gpupool_sim_inject_fault("cuMemMap", UINT32_MAX, GPUPOOL_SIM_FAULT_ERROR));
  void *p = NULL;
  CHECK_OK(gpupool_malloc(&p, 64 * MIB, 0, S));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_sim_clear_faults(&pending));
  CHECK(pending == 1);
  CHECK_OK(gpupool_empty_cache(0));
}

/* Sleeps and wakes the default pools of device 0 and a sleepable pool of device 1, freeing a
 * block of each while they sleep. */
#define ROUNDS 10

static volatile int stop;

static void *sleeper(void *arg) {
  uint64_t pool1 = *(uint64_t *)arg;
  for (int r = 0; r < ROUNDS; r++) {
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    CHECK_OK(gpupool_malloc(&a, 30 * MIB, 0, S));
    CHECK_OK(gpupool_malloc(&b, 30 * MIB, 0, S));
    CHECK_OK(gpupool_begin_allocate_to_pool(1, pool1, S));
    CHECK_OK(gpupool_malloc(&c, 30 * MIB, 1, S));
    CHECK_OK(gpupool_malloc(&d, 30 * MIB, 1, S));
    CHECK_OK(gpupool_end_allocate_to_pool(1, pool1));
    memset(a, 0x5a, 4096);
    memset(d, 0xa5, 4096);
    CHECK_OK(gpupool_sleep(0, 0, r % 2 ? GPUPOOL_SLEEP_OFFLOAD : GPUPOOL_SLEEP_OFFLOAD_PINNED));
    CHECK_OK(gpupool_sleep(1, pool1, GPUPOOL_SLEEP_OFFLOAD));
    CHECK_OK(gpupool_free(b));
    CHECK_OK(gpupool_free(c));
    size_t bytes = 1;
    CHECK_OK(gpupool_largest_allocatable(0, S, &bytes));
    CHECK(bytes == 0);
    CHECK_OK(gpupool_empty_cache(-1));
    CHECK_OK(gpupool_wake(1, pool1));
    CHECK_OK(gpupool_wake(0, 0));
    CHECK(((unsigned char *)a)[4095] == 0x5a && ((unsigned char *)d)[0] == 0xa5);
    CHECK_OK(gpupool_free(a));
    CHECK_OK(gpupool_free(d));
  }
  stop = 1;
  return NULL;
}

static void *asker(void *arg) {
  (void)arg;
  size_t capacity = 1024 * MIB, bytes = 0;
  long asked = 0;
  while (!stop) {
    for (int dev = 0; dev < 2; dev++) {
      CHECK_OK(gpupool_largest_allocatable(dev, S, &bytes));
      CHECK(bytes <= capacity);
      asked++;
    }
  }
  CHECK(asked > 0);
  return NULL;
}

static void test_largest_racing_sleep(void) {
  int count = 0;
  CHECK_OK(gpupool_device_count(&count));
  if (count < 2) {
    printf("test_hostile_sleep: largest race skipped (needs GPUPOOL_SIM_DEVICES=2)\n");
    return;
  }
  uint64_t pool1 = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool1));
  pthread_t s, q[2];
  pthread_create(&s, NULL, sleeper, &pool1);
  for (int i = 0; i < 2; i++) pthread_create(&q[i], NULL, asker, NULL);
  pthread_join(s, NULL);
  for (int i = 0; i < 2; i++) pthread_join(q[i], NULL);
  CHECK_OK(gpupool_release_pool(1, pool1));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK_OK(gpupool_empty_cache(1));
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver == NULL || strcmp(driver, "sim") != 0) {
    printf("test_hostile_sleep: skipped (needs GPUPOOL_DRIVER=sim)\n");
    return 77;
  }
  test_inject_arguments();
  test_pool_ids();
  test_largest_racing_sleep();
  return checks_report("test_hostile_sleep");
}
