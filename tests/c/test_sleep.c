/* Sleep and wake through the C API on the simulated device (GPUPOOL_DRIVER=sim, whose device
 * memory is host memory that this test reads and writes): the default pools and a sleepable
 * private pool given back and restored bit for bit at the same addresses, discard, allocations
 * refused while asleep and frees allowed, the statistics' sleeping bytes (and an older caller's
 * smaller struct left untouched), and bad input, each refused with a message that starts with
 * the function's name and names the problem. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "check.h"

#define MIB ((size_t)1 << 20)

static int starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }
static int contains(const char *s, const char *part) { return strstr(s, part) != NULL; }

static void fill(void *p, size_t n, unsigned char seed) {
  unsigned char *b = (unsigned char *)p;
  for (size_t i = 0; i < n; i++) b[i] = (unsigned char)(i * 31u + seed);
}

static int holds(const void *p, size_t n, unsigned char seed) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != (unsigned char)(i * 31u + seed)) return 0;
  return 1;
}

static gpupool_stats_t stats(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s;
}

static void test_default_pools(void) {
  gpupool_stream_t s = (gpupool_stream_t)0x10;
  void *w = NULL, *kv = NULL, *other = NULL;
  CHECK_OK(gpupool_malloc(&w, 3 * MIB + 5, 0, s));
  CHECK_OK(gpupool_malloc(&kv, 8 * MIB, 0, s));
  fill(w, 3 * MIB + 5, 1);
  int64_t reserved = stats().reserved_bytes.all.current;
  CHECK_OK(gpupool_sleep(0, 0, GPUPOOL_SLEEP_OFFLOAD));
  gpupool_stats_t st = stats();
  CHECK(st.sleeping_bytes.current == reserved && st.reserved_bytes.all.current == reserved);
  CHECK(gpupool_malloc(&other, 512, 0, s) == GPUPOOL_ERROR_INVALID_VALUE && other == NULL);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_malloc: the default pools of device 0 sleep"));
  CHECK(gpupool_sleep(0, 0, GPUPOOL_SLEEP_DISCARD) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(contains(gpupool_last_error_message(), "sleep already"));
  CHECK_OK(gpupool_free(kv)); /* frees are allowed */
  CHECK_OK(gpupool_wake(0, 0));
  CHECK(holds(w, 3 * MIB + 5, 1));
  CHECK(gpupool_wake(0, 0) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_wake: the default pools of device 0 do not sleep"));
  st = stats();
  CHECK(st.sleeping_bytes.current == 0 && st.sleeping_bytes.freed == reserved);
  CHECK_OK(gpupool_free(w));
  CHECK_OK(gpupool_empty_cache(0));
}

static void test_private_pool(void) {
  gpupool_stream_t s = (gpupool_stream_t)0x20;
  uint64_t pool = 0, plain = 0;
  CHECK_OK(gpupool_pool_create_sleepable(&pool));
  CHECK_OK(gpupool_pool_create(&plain));
  CHECK(pool != 0 && (pool >> 62 & 1) == 1 && (plain >> 62 & 1) == 0);
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
  void *a = NULL, *b = NULL;
  CHECK_OK(gpupool_malloc(&a, 6 * MIB, 0, s));
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  fill(a, 6 * MIB, 2);
  gpupool_stats_t ps = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_pool_stats(0, pool, &ps));
  int64_t reserved = ps.reserved_bytes.all.current;
  CHECK_OK(gpupool_sleep(0, pool, GPUPOOL_SLEEP_DISCARD));
  CHECK_OK(gpupool_pool_stats(0, pool, &ps));
  CHECK(ps.sleeping_bytes.current == reserved);
  CHECK_OK(gpupool_malloc(&b, MIB, 0, s)); /* the default pools allocate meanwhile */
  CHECK(gpupool_release_pool(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_wake(0, pool));
  fill(a, 6 * MIB, 3);
  CHECK(holds(a, 6 * MIB, 3));
  CHECK_OK(gpupool_free(a));
  CHECK_OK(gpupool_free(b));
  CHECK_OK(gpupool_release_pool(0, pool));
  /* A pool from gpupool_pool_create has ordinary segments: refused, with the way out. */
  CHECK(gpupool_sleep(0, plain, GPUPOOL_SLEEP_OFFLOAD) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(contains(gpupool_last_error_message(), "gpupool_pool_create_sleepable"));
}

static void test_bad_input(void) {
  CHECK(gpupool_sleep(0, 0, 7) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_sleep: mode 7 is not a sleep mode"));
  CHECK(gpupool_sleep(0, 0, 0) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sleep(5, 0, GPUPOOL_SLEEP_OFFLOAD) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(contains(gpupool_last_error_message(), "out of range"));
  CHECK(gpupool_sleep(0, (uint64_t)1 << 40, GPUPOOL_SLEEP_OFFLOAD) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(contains(gpupool_last_error_message(), "never created"));
  CHECK(gpupool_wake(0, UINT64_MAX) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_pool_create_sleepable(NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_pool_create_sleepable: pool is NULL"));
  /* A caller built against version 2 of the stats struct: sleeping_bytes is left alone. */
  gpupool_stats_t s;
  memset(&s, 0xab, sizeof s);
  s.size = (uint32_t)offsetof(gpupool_stats_t, sleeping_bytes);
  CHECK_OK(gpupool_stats(0, &s));
  const unsigned char *tail = (const unsigned char *)&s.sleeping_bytes;
  CHECK(tail[0] == 0xab && tail[sizeof s.sleeping_bytes - 1] == 0xab);
  CHECK(s.version == GPUPOOL_STATS_VERSION && GPUPOOL_STATS_VERSION == 4);
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver == NULL || strcmp(driver, "sim") != 0) {
    printf("test_sleep: skipped (needs GPUPOOL_DRIVER=sim; tests/gpu/test_sleep.cu runs on a GPU)\n");
    return 77;
  }
  test_bad_input();
  test_default_pools();
  test_private_pool();
  return checks_report("test_sleep");
}
