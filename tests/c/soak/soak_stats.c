/* The soak's checks of the statistics, and the thread that reads them (soak.h). */
#define _POSIX_C_SOURCE 200809L

#include "soak.h"

/* ---- the statistics thread --------------------------------------------------------------- */

atomic_long snapshots;

void check_stat(const char *what, int device, const gpupool_stat_t *s) {
  if (s->current > s->peak)
    fail("device %d %s: current %" PRId64 " > peak %" PRId64, device, what, s->current, s->peak);
  if (s->allocated - s->freed != s->current)
    fail("device %d %s: allocated %" PRId64 " - freed %" PRId64 " != current %" PRId64, device, what,
         s->allocated, s->freed, s->current);
  if (s->current < 0) fail("device %d %s: current %" PRId64 " < 0", device, what, s->current);
}

static void check_array(const char *what, int device, const gpupool_stat_array_t *a) {
  check_stat(what, device, &a->all);
  check_stat(what, device, &a->small_pool);
  check_stat(what, device, &a->large_pool);
  if (a->all.current != a->small_pool.current + a->large_pool.current)
    fail("device %d %s: all.current %" PRId64 " != small %" PRId64 " + large %" PRId64, device, what,
         a->all.current, a->small_pool.current, a->large_pool.current);
  if (a->all.peak > a->small_pool.peak + a->large_pool.peak)
    fail("device %d %s: all.peak %" PRId64 " > small_pool.peak %" PRId64 " + large_pool.peak %" PRId64
         " (by %" PRId64 ")",
         device, what, a->all.peak, a->small_pool.peak, a->large_pool.peak,
         a->all.peak - a->small_pool.peak - a->large_pool.peak);
}

#define ARRAYS(X)                                                                             \
  X(allocation) X(segment) X(active) X(inactive_split) X(allocated_bytes) X(reserved_bytes)    \
  X(active_bytes) X(inactive_split_bytes) X(requested_bytes)

gpupool_stats_t check_snapshot(int device) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  EXPECT_STATUS(gpupool_stats(device, &s), GPUPOOL_SUCCESS);
#define CHECK_ARRAY(name) check_array(#name, device, &s.name);
  ARRAYS(CHECK_ARRAY)
#undef CHECK_ARRAY
  check_stat("oversize_allocations", device, &s.oversize_allocations);
  check_stat("oversize_segments", device, &s.oversize_segments);
  atomic_fetch_add(&snapshots, 1);
  return s;
}

void pause_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* The pinned statistics, read while the workers run: each of one moment (the call holds
 * every lock of the host allocator), so the blocks in use are among those held. */
void check_host_snapshot(void) {
  gpupool_host_stats_t h = GPUPOOL_HOST_STATS_INIT;
  EXPECT_STATUS(gpupool_host_stats(&h), GPUPOOL_SUCCESS);
  check_stat("host active_requests", -1, &h.active_requests);
  check_stat("host active_bytes", -1, &h.active_bytes);
  check_stat("host allocations", -1, &h.allocations);
  check_stat("host allocated_bytes", -1, &h.allocated_bytes);
  if (h.active_requests.current > h.allocations.current || h.active_bytes.current > h.allocated_bytes.current)
    fail("host: %" PRId64 " blocks (%" PRId64 " bytes) in use, more than the %" PRId64 " (%" PRId64 " bytes) held",
         h.active_requests.current, h.active_bytes.current, h.allocations.current, h.allocated_bytes.current);
}


void *stats_thread(void *arg) {
  (void)arg;
  uint64_t rng = seed ^ UINT64_C(0x5eed5eed5eed5eed);
  while (atomic_load(&workers_done) < nthreads) {
    int device = (int)below(&rng, (uint64_t)ndevices);
    check_snapshot(device);
    check_host_snapshot();
    uint64_t r = below(&rng, 1000);
    if (r < 20) {
      EXPECT_STATUS(gpupool_reset_peak_stats(device), GPUPOOL_SUCCESS);
    } else if (r < 25) {
      empty_cache(below(&rng, 2) ? device : -1);
      EXPECT_STATUS(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
    } else if (r < 35) {
      /* The answer may be stale by the time it returns (other threads allocate meanwhile);
       * what must hold is that the call succeeds and changes nothing the snapshots see. */
      size_t bytes = SIZE_MAX;
      EXPECT_STATUS(gpupool_largest_allocatable(device, side_stream((int)below(&rng, SIDE_STREAMS)), &bytes),
                    GPUPOOL_SUCCESS);
      if (bytes == SIZE_MAX) fail("gpupool_largest_allocatable left its answer unset");
    } else if (r < 40) {
      /* The summary may grow between the size query and the call (other threads add streams,
       * pools and rows meanwhile): as a caller would, ask again with the size it reports, a
       * few times; each refusal must say how much it needs. */
      size_t need = 0;
      EXPECT_STATUS(gpupool_memory_summary(device, NULL, 0, &need), GPUPOOL_SUCCESS);
      for (int tries = 0; tries < 8; tries++) {
        size_t len = need + 256;
        char *text = malloc(len);
        if (!text) break;
        gpupool_status st = gpupool_memory_summary(device, text, len, &need);
        if (st == GPUPOOL_SUCCESS) {
          if (!strstr(text, "gpupool memory summary")) fail("the memory summary has no title");
          free(text);
          break;
        }
        free(text);
        if (st != GPUPOOL_ERROR_INVALID_VALUE || need <= len) {
          fail("gpupool_memory_summary refused a buffer without asking for a larger one");
          break;
        }
      }
    }
    pause_us(50);
  }
  return NULL;
}

