/* Fault injection through gpupool_testing.h (issue 40): a C test fails any later driver call by
 * its CUDA name and finds every pool as it was. A growth whose cuMemMap fails, a sleep whose
 * host copy (mmap) or copy (cuMemcpyDtoHAsync_v2) fails, a wake whose cuMemCreate fails, and a
 * panic injected into cuMemCreate: each refused with its status, the statistics and every
 * block's contents unchanged, and the same call succeeding once the fault has fired. Bad names
 * and kinds are refused. Needs GPUPOOL_DRIVER=sim (skipped otherwise). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "gpupool_testing.h"
#include "check.h"

#define MIB ((size_t)1 << 20)
#define S ((gpupool_stream_t)0x10)

static int64_t reserved(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s.reserved_bytes.all.current;
}

static void fill(void *p, size_t n, unsigned char seed) {
  for (size_t i = 0; i < n; i += 4096) ((unsigned char *)p)[i] = (unsigned char)(seed + i / 4096);
}

static int holds(const void *p, size_t n, unsigned char seed) {
  for (size_t i = 0; i < n; i += 4096)
    if (((const unsigned char *)p)[i] != (unsigned char)(seed + i / 4096)) return 0;
  return 1;
}

static void expect_no_pending(void) {
  size_t pending = 99;
  CHECK_OK(gpupool_sim_clear_faults(&pending));
  CHECK(pending == 0);
}

static void test_bad_arguments(void) {
  CHECK(gpupool_sim_inject_fault(NULL, 0, GPUPOOL_SIM_FAULT_ERROR) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sim_inject_fault("cudaMalloc", 0, GPUPOOL_SIM_FAULT_ERROR) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "cuMemMap") != NULL); /* the list of names */
  CHECK(gpupool_sim_inject_fault("cuMemMap", 0, 4) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sim_inject_fault("cuMemMap", 0, UINT32_MAX) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sim_inject_fault("", 0, GPUPOOL_SIM_FAULT_ERROR) == GPUPOOL_ERROR_INVALID_VALUE);
  expect_no_pending();
  CHECK_OK(gpupool_sim_clear_faults(NULL));
}

static void test_a_failed_growth(void) {
  int64_t before = reserved();
  void *p = NULL;
  /* A mapping the driver refuses: the growth falls back to an ordinary segment (cuMemAlloc). */
  CHECK_OK(gpupool_sim_inject_fault("cuMemMap", 0, GPUPOOL_SIM_FAULT_ERROR));
  CHECK_OK(gpupool_malloc(&p, 64 * MIB, 0, S));
  expect_no_pending();
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(reserved() == before);
  /* And the fallback refused too: the request fails with the driver's error, nothing kept. */
  p = NULL;
  CHECK_OK(gpupool_sim_inject_fault("cuMemMap", 0, GPUPOOL_SIM_FAULT_ERROR));
  CHECK_OK(gpupool_sim_inject_fault("cuMemAlloc_v2", 0, GPUPOOL_SIM_FAULT_ERROR));
  CHECK(gpupool_malloc(&p, 64 * MIB, 0, S) == GPUPOOL_ERROR_CUDA);
  CHECK(p == NULL && reserved() == before);
  expect_no_pending();
  CHECK_OK(gpupool_sim_inject_fault("cuMemCreate", 0, GPUPOOL_SIM_FAULT_OUT_OF_MEMORY));
  CHECK(gpupool_malloc(&p, 64 * MIB, 0, S) == GPUPOOL_ERROR_OUT_OF_MEMORY || p != NULL);
  if (p != NULL) CHECK_OK(gpupool_free(p)); /* served after releasing the cache and retrying */
  expect_no_pending();
  CHECK_OK(gpupool_empty_cache(0)); /* so that the next request needs a new page */
  p = NULL;
  CHECK_OK(gpupool_sim_inject_fault("cuMemCreate", 0, GPUPOOL_SIM_FAULT_PANIC));
  CHECK(gpupool_malloc(&p, 64 * MIB, 0, S) == GPUPOOL_ERROR_INTERNAL);
  CHECK(p == NULL);
  expect_no_pending();
  CHECK_OK(gpupool_malloc(&p, 64 * MIB, 0, S));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(reserved() == before);
}

static void test_sleep_and_wake_faults(void) {
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool));
  void *a = NULL, *b = NULL;
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, S));
  CHECK_OK(gpupool_malloc(&a, 30 * MIB, 0, S));
  CHECK_OK(gpupool_malloc(&b, 5 * MIB, 0, S));
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  fill(a, 30 * MIB, 1);
  fill(b, 5 * MIB, 2);
  const char *before_pages[] = {"mmap", "cuMemcpyDtoHAsync_v2", "cuEventRecord"};
  for (size_t i = 0; i < sizeof before_pages / sizeof before_pages[0]; i++) {
    CHECK_OK(gpupool_sim_inject_fault(before_pages[i], 0, GPUPOOL_SIM_FAULT_ERROR));
    gpupool_status st = gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD);
    CHECK(st == GPUPOOL_ERROR_CUDA || st == GPUPOOL_ERROR_OUT_OF_MEMORY);
    expect_no_pending();
    /* Awake and as it was: it allocates, and the blocks hold their bytes. */
    void *c = NULL;
    CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, S));
    CHECK_OK(gpupool_malloc(&c, 4096, 0, S));
    CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
    CHECK_OK(gpupool_free(c));
    CHECK(holds(a, 30 * MIB, 1) && holds(b, 5 * MIB, 2));
  }
  CHECK_OK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_OFFLOAD));
  const char *at_wake[] = {"cuMemCreate", "cuMemMap", "cuMemcpyHtoDAsync_v2"};
  for (size_t i = 0; i < sizeof at_wake / sizeof at_wake[0]; i++) {
    CHECK_OK(gpupool_sim_inject_fault(at_wake[i], 0, GPUPOOL_SIM_FAULT_ERROR));
    CHECK(gpupool_wake(0, pool) == GPUPOOL_ERROR_CUDA);
    expect_no_pending();
  }
  CHECK_OK(gpupool_wake(0, pool));
  CHECK(holds(a, 30 * MIB, 1) && holds(b, 5 * MIB, 2));
  CHECK_OK(gpupool_free(a));
  CHECK_OK(gpupool_free(b));
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK_OK(gpupool_empty_cache(0));
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver == NULL || strcmp(driver, "sim") != 0) {
    printf("test_faults: skipped (needs GPUPOOL_DRIVER=sim)\n");
    return 77;
  }
  test_bad_arguments();
  test_a_failed_growth();
  test_sleep_and_wake_faults();
  return checks_report("test_faults");
}
