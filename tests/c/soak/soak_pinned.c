/* The soak's pinned host memory (soak.h). */
#define _POSIX_C_SOURCE 200809L

#include "soak.h"

/* ---- pinned host memory ------------------------------------------------------------------ */

/* Each worker keeps up to PINNED_CAP pinned blocks (more than the 8 a stripe's stack of
 * handed-out blocks holds, so that frees also find blocks in its map), with a cookie at both
 * ends checked at the free (a block handed out twice is overwritten by its second owner);
 * names one of its streams for some (gpupool_host_record_event: the free then waits for the
 * event, and the stripe's hit path gives way to the full one); passes blocks to other threads
 * through a shared box, to be freed there; and frees inside a block, which is refused. */
static pthread_mutex_t pinned_box_lock = PTHREAD_MUTEX_INITIALIZER;
pinned_t pinned_box[PINNED_BOX_CAP];
int npinned_box;
atomic_long n_pinned, n_pinned_handed, n_pinned_events;

/* Mostly up to 64 KiB, some up to 1 MiB, a few of the classes above 1 MiB. */
static size_t draw_pinned_size(uint64_t *rng) {
  uint64_t r = below(rng, 100);
  if (r < 70) return 16 + below(rng, 64 << 10);
  if (r < 95) return 16 + below(rng, MIB);
  return MIB + below(rng, 2 * MIB);
}

void pinned_free(const pinned_t *b) {
  uint64_t first, last;
  memcpy(&first, b->p, 8);
  memcpy(&last, (char *)b->p + b->size - 8, 8);
  if (first != b->cookie || last != b->cookie)
    fail("pinned block %p (%zu bytes): cookies %#" PRIx64 " and %#" PRIx64 " where %#" PRIx64
         " was written: handed out twice?",
         b->p, b->size, first, last, b->cookie);
  gpupool_status st = gpupool_host_free(b->p);
  if (st != GPUPOOL_SUCCESS)
    fail("gpupool_host_free(%p) returned %s: %s", b->p, gpupool_status_string(st), gpupool_last_error_message());
}

void pinned_op(int t, uint64_t *rng, pinned_t *mine, int *n, uint64_t *counter) {
  uint64_t r = below(rng, 100);
  if (*n < 2 || (r < 50 && *n < PINNED_CAP)) {
    pinned_t b = {NULL, draw_pinned_size(rng), 0};
    gpupool_status st = gpupool_host_malloc(&b.p, b.size);
    atomic_fetch_add(&n_pinned, 1);
    if (st != GPUPOOL_SUCCESS || !b.p) {
      fail("gpupool_host_malloc(%zu bytes) returned %s: %s", b.size, gpupool_status_string(st),
           gpupool_last_error_message());
      return;
    }
    b.cookie = ((uint64_t)(t + 1) << 48) | (UINT64_C(1) << 47) | ++*counter;
    memcpy(b.p, &b.cookie, 8);
    memcpy((char *)b.p + b.size - 8, &b.cookie, 8);
    if (below(rng, 8) == 0) {
      EXPECT_STATUS(gpupool_host_record_event(b.p, own_stream(t, (int)below(rng, OWN_STREAMS))), GPUPOOL_SUCCESS);
      atomic_fetch_add(&n_pinned_events, 1);
    }
    mine[(*n)++] = b;
    return;
  }
  if (r < 53) {
    const pinned_t *b = &mine[below(rng, (uint64_t)*n)];
    EXPECT_STATUS(gpupool_host_free((char *)b->p + 8), GPUPOOL_ERROR_INVALID_POINTER);
    atomic_fetch_add(&n_bad, 1);
    return;
  }
  int k = (int)below(rng, (uint64_t)*n);
  pinned_t b = mine[k];
  mine[k] = mine[--*n];
  if (r < 70) {
    /* Through the box: leave this one there, and free one another thread left. */
    pinned_t other = {NULL, 0, 0};
    pthread_mutex_lock(&pinned_box_lock);
    if (npinned_box > 0 && below(rng, 2)) other = pinned_box[--npinned_box];
    if (npinned_box < PINNED_BOX_CAP) {
      pinned_box[npinned_box++] = b;
      b.p = NULL;
    }
    pthread_mutex_unlock(&pinned_box_lock);
    if (other.p) {
      pinned_free(&other);
      atomic_fetch_add(&n_pinned_handed, 1);
    }
    if (!b.p) return;
  }
  pinned_free(&b);
}
