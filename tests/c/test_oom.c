/* Out-of-memory observers through the C API, on the simulated device of 64 MiB
 * (GPUPOOL_DRIVER=sim GPUPOOL_SIM_CAPACITY=64MiB): called in the order attached, once per failed
 * request, with the device, the size asked and the statistics; free memory and read statistics
 * from inside (no lock of gpupool's is held); ask for one more attempt with gpupool_oom_retry;
 * detached. The sizes assume the simulated device: on another driver the test is skipped
 * (tests/gpu/test_gpu.cu has an observer on a real device). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "check.h"

#define MIB ((size_t)1 << 20)

/* What the observers saw, in the order they were called. */
struct seen {
  int calls;
  int order[16];
  int device;
  size_t requested;
  int64_t num_ooms;
  uint32_t stats_size;
};

/* The first observer frees `spare` when set, and asks for a retry when `ask_retry` is. */
static void *spare;
static int ask_retry;

static void first(int device, size_t requested, const gpupool_stats_t *stats, void *user) {
  struct seen *seen = user;
  if (seen->calls < 16) seen->order[seen->calls] = 1;
  seen->calls++;
  seen->device = device;
  seen->requested = requested;
  seen->num_ooms = stats->num_ooms;
  seen->stats_size = stats->size;
  /* No lock is held: the statistics, which take every lock of the device, can be read. */
  gpupool_stats_t now = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(device, &now));
  CHECK(now.num_ooms == stats->num_ooms && now.reserved_bytes.all.current == stats->reserved_bytes.all.current);
  if (spare != NULL) {
    CHECK_OK(gpupool_free(spare));
    spare = NULL;
  }
  if (ask_retry) CHECK_OK(gpupool_oom_retry());
}

static void second(int device, size_t requested, const gpupool_stats_t *stats, void *user) {
  (void)device;
  (void)requested;
  (void)stats;
  struct seen *seen = user;
  if (seen->calls < 16) seen->order[seen->calls] = 2;
  seen->calls++;
}

static int64_t num_ooms(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s.num_ooms;
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver == NULL || strcmp(driver, "sim") != 0) {
    printf("test_oom: skipped, the sizes assume GPUPOOL_DRIVER=sim with 64 MiB\n");
    return 77;
  }
  struct seen seen;
  memset(&seen, 0, sizeof seen);

  /* Outside an observer there is no request to retry. */
  CHECK(gpupool_oom_retry() == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "gpupool_oom_retry: not called from inside") != NULL);

  CHECK(gpupool_attach_oom_observer(NULL, &seen) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_attach_oom_observer(first, &seen));
  CHECK(gpupool_attach_oom_observer(first, &seen) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "attached already") != NULL);
  CHECK_OK(gpupool_attach_oom_observer(second, &seen));

  /* A request larger than the device: both observers, in order, once. */
  void *p = (void *)0x1;
  CHECK(gpupool_malloc(&p, 100 * MIB + 5, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(p == (void *)0x1);
  CHECK(seen.calls == 2 && seen.order[0] == 1 && seen.order[1] == 2);
  CHECK(seen.device == 0 && seen.requested == 100 * MIB + 5);
  CHECK(seen.num_ooms == 1 && num_ooms() == 1);
  CHECK(seen.stats_size == sizeof(gpupool_stats_t));
  CHECK(strncmp(gpupool_last_error_message(), "gpupool_malloc: CUDA out of memory.", 35) == 0);
  CHECK(strstr(gpupool_last_error_message(), "Largest free block over all streams: none in the small pool") != NULL);

  /* The first observer frees a live block and asks for a retry: the request is served from it.
   * 40 MiB held, 24 MiB left: 30 MiB fits only in the freed block. */
  void *keep = NULL, *q = NULL;
  CHECK_OK(gpupool_malloc(&keep, 40 * MIB, 0, NULL));
  spare = keep;
  ask_retry = 1;
  CHECK_OK(gpupool_malloc(&q, 30 * MIB, 0, NULL));
  CHECK(q == keep);
  CHECK(seen.calls == 4 && seen.order[2] == 1 && seen.order[3] == 2);
  CHECK(num_ooms() == 2);
  CHECK_OK(gpupool_free(q));
  CHECK_OK(gpupool_empty_cache(0));

  /* Without the retry, the same request fails; the block freed by the observer serves the next
   * one, which calls no observer. */
  CHECK_OK(gpupool_malloc(&keep, 40 * MIB, 0, NULL));
  spare = keep;
  ask_retry = 0;
  CHECK(gpupool_malloc(&q, 30 * MIB, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(seen.calls == 6);
  CHECK_OK(gpupool_malloc(&q, 30 * MIB, 0, NULL));
  CHECK(q == keep && seen.calls == 6);
  CHECK_OK(gpupool_free(q));

  /* A retry that fails again calls no observer again. */
  ask_retry = 1;
  CHECK(gpupool_malloc(&q, 100 * MIB, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(seen.calls == 8);
  CHECK(num_ooms() == 4);
  ask_retry = 0;

  /* Detached, an observer is called no more. */
  CHECK_OK(gpupool_detach_oom_observer(second, &seen));
  CHECK(gpupool_detach_oom_observer(second, &seen) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_malloc(&q, 100 * MIB, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(seen.calls == 9 && seen.order[8] == 1);
  CHECK_OK(gpupool_detach_oom_observer(first, &seen));
  CHECK(gpupool_malloc(&q, 100 * MIB, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(seen.calls == 9);
  CHECK(num_ooms() == 6);
  /* Attached again after its detach: the pair is free again. */
  CHECK_OK(gpupool_attach_oom_observer(second, &seen));
  CHECK_OK(gpupool_detach_oom_observer(second, &seen));

  CHECK_OK(gpupool_empty_cache(0));
  return checks_report("test_oom");
}
