/* Pinned host memory through the C API (gpupool_host_*), on the simulated device: rounding,
 * reuse only after the recorded events, statistics, empty_cache, bad input, and threads
 * staging for their own streams. Run with GPUPOOL_DRIVER=sim; on another driver the checks
 * that hold a stream are skipped (exit 77 when nothing could run). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "gpupool_testing.h"
#include "check.h"

static gpupool_host_stats_t host_stats(void) {
  gpupool_host_stats_t s = GPUPOOL_HOST_STATS_INIT;
  CHECK_OK(gpupool_host_stats(&s));
  return s;
}

static int is_pinned(const void *p, size_t len) {
  int pinned = -1;
  CHECK_OK(gpupool_sim_host_pinned(p, len, &pinned));
  return pinned;
}

#define THREADS 4
#define ROUNDS 2000

/* One thread staging for its own stream: a ring of 4 buffers, each written, "copied"
 * (record_event), freed and allocated again; a cookie per live buffer catches a block handed
 * out twice. */
static void *stage(void *arg) {
  uintptr_t t = (uintptr_t)arg;
  /* The simulated device takes any handle; a real driver takes only live streams, and
   * CU_STREAM_PER_THREAD (2) is each thread's own. */
  const char *driver = getenv("GPUPOOL_DRIVER");
  int sim = driver && strcmp(driver, "sim") == 0;
  gpupool_stream_t stream = sim ? (gpupool_stream_t)(0x1000 * (t + 1)) : (gpupool_stream_t)2;
  void *ring[4] = {0};
  int failures = 0;
  for (int i = 0; i < ROUNDS; i++) {
    int slot = i % 4;
    if (ring[slot]) {
      if (*(uint64_t *)ring[slot] != ((uint64_t)t << 32 | (uint64_t)(i - 4))) failures++;
      if (gpupool_host_free(ring[slot]) != GPUPOOL_SUCCESS) failures++;
    }
    size_t size = (size_t)(64 << 10) << (i % 5);
    if (gpupool_host_malloc(&ring[slot], size) != GPUPOOL_SUCCESS || !ring[slot]) {
      failures++;
      ring[slot] = NULL;
      continue;
    }
    *(uint64_t *)ring[slot] = (uint64_t)t << 32 | (uint64_t)i;
    if (gpupool_host_record_event(ring[slot], stream) != GPUPOOL_SUCCESS) failures++;
  }
  for (int s = 0; s < 4; s++)
    if (ring[s] && gpupool_host_free(ring[s]) != GPUPOOL_SUCCESS) failures++;
  return (void *)(uintptr_t)failures;
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  int sim = driver && strcmp(driver, "sim") == 0;

  /* Size 0: NULL and success, as PyTorch. */
  void *p = (void *)0x1;
  CHECK_OK(gpupool_host_malloc(&p, 0));
  CHECK(p == NULL);
  CHECK(gpupool_host_malloc(NULL, 16) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "gpupool_host_malloc: ptr is NULL") != NULL);

  /* Rounded to a power of two; a request of the same class takes the freed block. */
  CHECK_OK(gpupool_host_malloc(&p, 3000));
  CHECK(p != NULL);
  if (p) memset(p, 0x5a, 4096); /* the whole 4 KiB block is the caller's */
  if (sim) CHECK(is_pinned(p, 4096) == 1);
  gpupool_host_stats_t s = host_stats();
  CHECK(s.active_requests.current == 1 && s.active_bytes.current == 4096);
  CHECK(s.allocations.current == 1 && s.allocated_bytes.current == 4096 && s.num_host_alloc == 1);
  CHECK(s.version == GPUPOOL_HOST_STATS_VERSION && s.size == sizeof s);
  CHECK_OK(gpupool_host_free(p));
  void *q = NULL;
  CHECK_OK(gpupool_host_malloc(&q, 2049));
  CHECK(q == p);
  CHECK(host_stats().num_host_alloc == 1);

  /* Bad input: a status, a message naming the problem, nothing changed. */
  char local[64];
  gpupool_host_stats_t before = host_stats();
  CHECK(gpupool_host_free(local) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strstr(gpupool_last_error_message(), "not pinned host memory") != NULL);
  CHECK(gpupool_host_free((char *)q + 8) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strstr(gpupool_last_error_message(), "inside the pinned block") != NULL);
  CHECK(gpupool_host_record_event(local, NULL) == GPUPOOL_ERROR_INVALID_POINTER);
  gpupool_host_stats_t after = host_stats();
  CHECK(after.active_requests.current == before.active_requests.current);
  CHECK(after.allocations.current == before.allocations.current);
  CHECK_OK(gpupool_host_free(NULL));
  CHECK_OK(gpupool_host_record_event(NULL, NULL));
  CHECK_OK(gpupool_host_free(q));
  CHECK(gpupool_host_free(q) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strstr(gpupool_last_error_message(), "freed already") != NULL);
  CHECK(gpupool_host_record_event(q, NULL) == GPUPOOL_ERROR_INVALID_POINTER);
  gpupool_host_stats_t small = {0};
  small.size = 4;
  CHECK(gpupool_host_stats(&small) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_host_stats(NULL) == GPUPOOL_ERROR_INVALID_VALUE);

  /* Reuse only after the events recorded for the block's streams completed. */
  if (sim) {
    gpupool_stream_t copy = (gpupool_stream_t)0x7000;
    CHECK_OK(gpupool_sim_hold_stream(copy));
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(gpupool_host_malloc(&a, 1 << 20));
    CHECK_OK(gpupool_host_record_event(a, copy));
    CHECK_OK(gpupool_host_free(a));
    CHECK_OK(gpupool_host_malloc(&b, 1 << 20));
    CHECK(b != a); /* the copy on the held stream may still read a */
    CHECK(host_stats().active_requests.current == 2);
    CHECK_OK(gpupool_host_empty_cache());
    CHECK(host_stats().allocations.current == 2); /* a waits for its event: it stays */
    CHECK_OK(gpupool_sim_release_stream(copy));
    CHECK_OK(gpupool_host_malloc(&c, 1 << 20));
    CHECK(c == a);
    CHECK_OK(gpupool_host_free(b));
    CHECK_OK(gpupool_host_free(c));
  }

  /* Threads staging for their own streams. */
  pthread_t threads[THREADS];
  for (uintptr_t t = 0; t < THREADS; t++) CHECK(pthread_create(&threads[t], NULL, stage, (void *)t) == 0);
  for (int t = 0; t < THREADS; t++) {
    void *failures = NULL;
    CHECK(pthread_join(threads[t], &failures) == 0);
    CHECK(failures == NULL);
  }
  /* Blocks freed after their last copy are still active until their events are polled (the
   * statistics poll nothing, as PyTorch's); empty_cache polls them, then gives every free
   * block back. */
  CHECK_OK(gpupool_host_empty_cache());
  s = host_stats();
  CHECK(s.active_requests.current == 0 && s.active_bytes.current == 0);
  CHECK(s.active_requests.allocated == s.active_requests.freed);
  CHECK(s.allocations.current == 0 && s.allocated_bytes.current == 0);
  CHECK(s.num_host_alloc == s.num_host_free);
  CHECK(s.host_alloc_time.count == s.num_host_alloc && s.host_free_time.count == s.num_host_free);
  CHECK_OK(gpupool_host_reset_peak_stats());
  CHECK(host_stats().active_requests.peak == 0);
  return checks_report("test_host");
}
