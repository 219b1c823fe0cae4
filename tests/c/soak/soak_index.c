/* The soak's errors, and its index of live and quarantined ranges (soak.h). */
#define _POSIX_C_SOURCE 200809L

#include "soak.h"

/* ---- errors ------------------------------------------------------------------------------ */

atomic_long errors;

void fail(const char *fmt, ...) {
  long n = atomic_fetch_add(&errors, 1);
  if (n >= 30) return; /* the first 30 are enough to see what went wrong */
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "soak: error: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

/* ---- the index of live and quarantined ranges -------------------------------------------- */

enum { LIVE = 1, QUARANTINED = 2 };

typedef struct {
  uintptr_t start, end;
  int state;
  unsigned awaits; /* QUARANTINED: bit k set while side stream k is held since the free */
  /* QUARANTINED: gpupool_sim_stream_waits of each side stream it awaits, read before the free:
   * once gpupool has waited for that stream since (the high-water rule waits for the stream
   * it grows on), its events have most likely completed. A wait between this read and the
   * free's own event would end the quarantine early (a reuse bug in that window would go
   * unseen); reading after the free instead would keep quarantines that a wait did end, and
   * report false overlaps. The simulated device's event tickets would make it exact. */
  uint64_t waits[SIDE_STREAMS];
} range_t;

pthread_mutex_t index_lock = PTHREAD_MUTEX_INITIALIZER;
static range_t *ranges;
static size_t nranges, cap_ranges;
/* Side streams held (changed only with index_lock held, together with the simulated device's
 * own state). */
unsigned held_mask;

/* Position of the first range that starts at or after `p`. */
static size_t lower_bound(uintptr_t p) {
  size_t lo = 0, hi = nranges;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (ranges[mid].start < p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Adds a block just handed out; returns 0 and reports an error if it overlaps a live block or
 * a freed block whose events are pending. Called with index_lock held. */
static void index_remove_at(size_t at);

static uint64_t side_waits(int k) {
  uint64_t n = 0;
  EXPECT_STATUS(gpupool_sim_stream_waits(side_stream(k), &n), GPUPOOL_SUCCESS);
  return n;
}

/* Whether the quarantined range at `at` still awaits a held side stream that gpupool has not
 * waited for since the free; one that awaits none leaves the index. */
static int still_awaits(size_t at) {
  range_t *r = &ranges[at];
  for (int k = 0; k < SIDE_STREAMS; k++)
    if ((r->awaits >> k) & 1 && side_waits(k) > r->waits[k]) r->awaits &= ~(1u << k);
  if (r->awaits) return 1;
  index_remove_at(at);
  return 0;
}

int index_add(uintptr_t p, size_t size, gpupool_stream_t stream) {
  size_t at;
  const range_t *clash;
  /* A clash with a quarantine that gpupool's waits have ended is none: that range leaves the
   * index and the neighbours are looked at again. */
  for (;;) {
    at = lower_bound(p);
    size_t c = nranges;
    if (at > 0 && ranges[at - 1].end > p) c = at - 1;
    if (at < nranges && ranges[at].start < p + size) c = at;
    if (c < nranges && ranges[c].state == QUARANTINED && !still_awaits(c)) continue;
    clash = c < nranges ? &ranges[c] : NULL;
    break;
  }
  if (clash) {
    fail("block %#" PRIxPTR " (%zu bytes, stream %p) overlaps %s %#" PRIxPTR "-%#" PRIxPTR, p, size,
         (void *)stream,
         clash->state == LIVE ? "the live block"
                              : "a block freed after record_stream whose events have not completed:",
         clash->start, clash->end);
    return 0;
  }
  if (nranges == cap_ranges) {
    cap_ranges = cap_ranges ? 2 * cap_ranges : 1024;
    ranges = realloc(ranges, cap_ranges * sizeof *ranges);
    if (!ranges) {
      fprintf(stderr, "soak: out of host memory\n");
      exit(2);
    }
  }
  memmove(&ranges[at + 1], &ranges[at], (nranges - at) * sizeof *ranges);
  ranges[at] = (range_t){p, p + size, LIVE, 0, {0}};
  nranges++;
  return 1;
}

static void index_remove_at(size_t at) {
  memmove(&ranges[at], &ranges[at + 1], (nranges - at - 1) * sizeof *ranges);
  nranges--;
}

/* The live block at `p` is about to be freed: it leaves the index, or stays as quarantined
 * while a held side stream it was used on has not been released. */
void index_free(uintptr_t p, unsigned side_uses) {
  size_t at = lower_bound(p);
  if (at == nranges || ranges[at].start != p || ranges[at].state != LIVE) {
    fail("block %#" PRIxPTR " is missing from the index", p);
    return;
  }
  unsigned awaits = side_uses & held_mask;
  if (awaits) {
    ranges[at].state = QUARANTINED;
    ranges[at].awaits = awaits;
    for (int k = 0; k < SIDE_STREAMS; k++)
      if ((awaits >> k) & 1) ranges[at].waits[k] = side_waits(k);
  } else {
    index_remove_at(at);
  }
}

/* Side stream k's work completed: what awaited only it may be handed out again. */
static void index_release(unsigned bit) {
  for (size_t i = 0; i < nranges;) {
    if (ranges[i].state == QUARANTINED && (ranges[i].awaits &= ~bit) == 0)
      index_remove_at(i);
    else
      i++;
  }
}

void hold_side(int k) {
  pthread_mutex_lock(&index_lock);
  EXPECT_STATUS(gpupool_sim_hold_stream(side_stream(k)), GPUPOOL_SUCCESS);
  held_mask |= 1u << k;
  pthread_mutex_unlock(&index_lock);
}

void release_side(int k) {
  pthread_mutex_lock(&index_lock);
  held_mask &= ~(1u << k);
  index_release(1u << k);
  EXPECT_STATUS(gpupool_sim_release_stream(side_stream(k)), GPUPOOL_SUCCESS);
  pthread_mutex_unlock(&index_lock);
}

/* empty_cache waits for every pending event (the simulated cuEventSynchronize completes a held
 * stream's work up to the event) and returns free segments to the driver, whose addresses a
 * new segment may then get: it runs with the index locked, ends every quarantine, and
 * excludes the workers' double-free checks (cache_lock). */
pthread_rwlock_t cache_lock = PTHREAD_RWLOCK_INITIALIZER;

void empty_cache(int device) {
  pthread_rwlock_wrlock(&cache_lock);
  pthread_mutex_lock(&index_lock);
  EXPECT_STATUS(gpupool_empty_cache(device), GPUPOOL_SUCCESS);
  for (size_t i = 0; i < nranges;) {
    if (ranges[i].state == QUARANTINED)
      index_remove_at(i);
    else
      i++;
  }
  pthread_mutex_unlock(&index_lock);
  pthread_rwlock_unlock(&cache_lock);
}

size_t index_size(void) {
  pthread_mutex_lock(&index_lock);
  size_t n = nranges;
  pthread_mutex_unlock(&index_lock);
  return n;
}

void index_destroy(void) {
  free(ranges);
  ranges = NULL;
  nranges = cap_ranges = 0;
}
