/* Private pools and CUDA graph capture through the C API, on the simulated device
 * (GPUPOOL_DRIVER=sim), whose captures fail every call CUDA forbids during capture: a capture
 * allocating from a private pool survives, a request the default pools cannot serve fails with
 * GPUPOOL_ERROR_STREAM_CAPTURE and leaves the capture intact, a failed capture's pool is
 * released to the byte, per-pool statistics, routes by thread and by filter, and bad input. */
#include <stdint.h>
#include <string.h>

#include "gpupool.h"
#include "gpupool_testing.h"
#include "check.h"

#define MIB ((size_t)1 << 20)

static gpupool_stream_t stream(uintptr_t v) { return (gpupool_stream_t)v; }

static int64_t reserved(int device) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  if (gpupool_stats(device, &s) != GPUPOOL_SUCCESS) return -1;
  return s.reserved_bytes.all.current;
}

static gpupool_stats_t pool_stats(uint64_t pool) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_pool_stats(0, pool, &s));
  return s;
}

/* A capture that allocates its activations from a private pool, frees them as it goes, and is
 * valid at the end; then the graph's pool is released and the device's reserved bytes are what
 * they were. */
static void test_capture_into_a_pool(void) {
  gpupool_stream_t s = stream(0x100);
  int64_t before = reserved(0);
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create(&pool));
  CHECK(pool != 0);
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, s));
  CHECK_OK(gpupool_sim_begin_capture(s, 0));
  void *x = NULL, *y = NULL;
  CHECK_OK(gpupool_malloc(&x, 8 * MIB, 0, s));
  for (int layer = 0; layer < 4; layer++) {
    CHECK_OK(gpupool_malloc(&y, 8 * MIB, 0, s));
    CHECK_OK(gpupool_free(x));
    x = y;
  }
  int valid = 0;
  CHECK_OK(gpupool_sim_end_capture(s, &valid));
  CHECK(valid == 1);
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  gpupool_stats_t ps = pool_stats(pool);
  CHECK(ps.allocation.all.current == 1);
  /* Two 8 MiB blocks at a time: freed blocks were reused within the capture. */
  CHECK(ps.allocated_bytes.all.peak == (int64_t)(16 * MIB));
  CHECK(reserved(0) == before + ps.reserved_bytes.all.current);
  /* The graph's segments survive empty_cache while the pool lives. */
  CHECK_OK(gpupool_free(x));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(pool_stats(pool).reserved_bytes.all.current == ps.reserved_bytes.all.current);
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK(pool_stats(pool).reserved_bytes.all.current == 0);
  CHECK(reserved(0) == before);
}

/* A request on a capturing stream that no cached block of the default pools fits fails with
 * GPUPOOL_ERROR_STREAM_CAPTURE, a message that says what to do, and an intact capture. */
static void test_default_pool_during_capture(void) {
  gpupool_stream_t s = stream(0x200);
  void *p = NULL;
  CHECK_OK(gpupool_sim_begin_capture(s, 0));
  CHECK(gpupool_malloc(&p, 64 * MIB, 0, s) == GPUPOOL_ERROR_STREAM_CAPTURE);
  CHECK(p == NULL);
  const char *msg = gpupool_last_error_message();
  CHECK(strstr(msg, "gpupool_malloc: ") == msg);
  CHECK(strstr(msg, "private pool") != NULL && strstr(msg, "warm-up") != NULL);
  int valid = 0;
  CHECK_OK(gpupool_sim_end_capture(s, &valid));
  CHECK(valid == 1);
  CHECK_OK(gpupool_malloc(&p, 64 * MIB, 0, s));
  CHECK_OK(gpupool_free(p));
  CHECK(strcmp(gpupool_status_string(GPUPOOL_ERROR_STREAM_CAPTURE), "not allowed during stream capture") == 0);
}

/* A capture broken by a call of the program's own that CUDA forbids (simulated): the pool is
 * released with a block still allocated; once it is freed, every byte is back. Emptying the
 * cache meanwhile is refused, since it would break the capture. */
static void test_failed_capture(void) {
  gpupool_stream_t s = stream(0x300);
  int64_t before = reserved(0);
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create(&pool));
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, s));
  CHECK_OK(gpupool_sim_begin_capture(s, 0));
  void *a = NULL, *b = NULL;
  CHECK_OK(gpupool_malloc(&a, 3 * MIB, 0, s));
  CHECK_OK(gpupool_malloc(&b, 30 * MIB, 0, s));
  CHECK_OK(gpupool_free(b));
  CHECK(gpupool_empty_cache(0) == GPUPOOL_ERROR_STREAM_CAPTURE);
  CHECK(strstr(gpupool_last_error_message(), "would break the capture") != NULL);
  CHECK_OK(gpupool_sim_invalidate_capture(s));
  int valid = 1;
  CHECK_OK(gpupool_sim_end_capture(s, &valid));
  CHECK(valid == 0);
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK(pool_stats(pool).segment.all.current == 1);
  CHECK_OK(gpupool_free(a));
  gpupool_stats_t ps = pool_stats(pool);
  CHECK(ps.reserved_bytes.all.current == 0 && ps.segment.all.current == 0);
  CHECK(reserved(0) == before);
  CHECK(gpupool_begin_allocate_to_pool(0, pool, s) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "released") != NULL);
}

static int filter_calls;
static int only_stream(void *user, gpupool_stream_t s) {
  filter_calls++;
  return s == (gpupool_stream_t)user;
}

/* Routes by thread and by filter; a filter is asked only while a route is active. */
static void test_thread_and_filter_routes(void) {
  uint64_t pool = 0;
  CHECK_OK(gpupool_pool_create(&pool));
  void *p = NULL, *q = NULL;
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, pool));
  CHECK_OK(gpupool_malloc(&p, MIB, 0, stream(0x400)));
  CHECK_OK(gpupool_malloc(&q, MIB, 0, stream(0x401)));
  CHECK(pool_stats(pool).allocation.all.current == 2);
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_free(q));

  CHECK_OK(gpupool_begin_allocate_to_pool_filter(0, pool, only_stream, (void *)stream(0x402)));
  CHECK_OK(gpupool_malloc(&p, MIB, 0, stream(0x402)));
  CHECK_OK(gpupool_malloc(&q, MIB, 0, stream(0x403)));
  CHECK(filter_calls == 2);
  CHECK(pool_stats(pool).allocation.all.current == 1);
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_free(q));
  CHECK_OK(gpupool_malloc(&p, MIB, 0, stream(0x402)));
  CHECK_OK(gpupool_free(p));
  CHECK(filter_calls == 2);
  /* The summary lists the pool. */
  char text[16384];
  size_t needed = 0;
  CHECK_OK(gpupool_memory_summary(0, text, sizeof text, &needed));
  CHECK(strstr(text, "Private pools") != NULL);
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK_OK(gpupool_empty_cache(0));
}

/* Every bad argument gets GPUPOOL_ERROR_INVALID_VALUE and a message naming it. */
static void test_bad_input(void) {
  uint64_t pool = 0;
  CHECK(gpupool_pool_create(NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_pool_create(&pool));
  CHECK(gpupool_begin_allocate_to_pool(0, 0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "default pools") != NULL);
  CHECK(gpupool_begin_allocate_to_pool(0, pool + 1000, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "never created") != NULL);
  CHECK(gpupool_begin_allocate_to_pool(99, pool, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_end_allocate_to_pool(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_begin_allocate_to_pool_filter(0, pool, NULL, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_begin_allocate_to_pool(0, pool, stream(0x500)));
  CHECK(gpupool_begin_allocate_to_pool(0, pool, stream(0x500)) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "already allocates") != NULL);
  CHECK_OK(gpupool_end_allocate_to_pool(0, pool));
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK(gpupool_pool_stats(0, 0, &s) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_pool_stats(0, pool, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_release_pool(0, pool));
  CHECK(gpupool_release_pool(0, pool) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_sim_begin_capture(stream(0x501), 7) == GPUPOOL_ERROR_INVALID_VALUE);
}

/* Only ids handed out name pools: not the sleepable bit over counter 0, not the plain twin of
 * a sleepable pool's id, nor the sleepable twin of a plain one (issue 40, defect 2: each was
 * accepted as a pool by every call). */
static void test_pools_nobody_created(void) {
  uint64_t plain = 0, sleepable = 0;
  CHECK_OK(gpupool_pool_create(&plain));
  CHECK_OK(gpupool_pool_create_sleepable(&sleepable));
  const uint64_t bit = (uint64_t)1 << 62;
  const uint64_t forged[] = {bit, sleepable & ~bit, plain | bit, ((uint64_t)1 << 63) | plain, UINT64_MAX};
  for (size_t i = 0; i < sizeof forged / sizeof forged[0]; i++) {
    uint64_t p = forged[i];
    gpupool_stats_t s = GPUPOOL_STATS_INIT;
    CHECK(gpupool_begin_allocate_to_pool(0, p, stream(0x600)) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(strstr(gpupool_last_error_message(), "never created") != NULL);
    CHECK(gpupool_begin_allocate_to_pool_thread(0, p) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(gpupool_pool_stats(0, p, &s) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(gpupool_sleep(0, p, GPUPOOL_SLEEP_DISCARD) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(gpupool_wake(0, p) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(gpupool_release_pool(0, p) == GPUPOOL_ERROR_INVALID_VALUE);
  }
  /* The ids handed out still work. */
  void *x = NULL;
  CHECK_OK(gpupool_begin_allocate_to_pool(0, sleepable, stream(0x600)));
  CHECK_OK(gpupool_malloc(&x, 4096, 0, stream(0x600)));
  CHECK_OK(gpupool_end_allocate_to_pool(0, sleepable));
  CHECK_OK(gpupool_free(x));
  CHECK_OK(gpupool_release_pool(0, sleepable));
  CHECK_OK(gpupool_release_pool(0, plain));
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver == NULL || strcmp(driver, "sim") != 0) {
    printf("test_pools: skipped (needs GPUPOOL_DRIVER=sim)\n");
    return 77;
  }
  test_capture_into_a_pool();
  test_default_pool_during_capture();
  test_failed_capture();
  test_thread_and_filter_routes();
  test_bad_input();
  test_pools_nobody_created();
  return checks_report("test_pools");
}
