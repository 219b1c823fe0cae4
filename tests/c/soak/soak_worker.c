/* The soak's workers (soak.h, test_soak.c). */
#define _POSIX_C_SOURCE 200809L

#include "soak.h"

#include <unistd.h>

/* ---- blocks and cookies ------------------------------------------------------------------ */

static void stamp(const block_t *b) {
  size_t n = b->size < 8 ? b->size : 8;
  memcpy(b->p, &b->cookie, n);
  if (b->size >= 16) memcpy((char *)b->p + b->size - 8, &b->cookie, 8);
}

static int stamped(const block_t *b) {
  uint64_t head = 0, tail = b->cookie;
  size_t n = b->size < 8 ? b->size : 8;
  memcpy(&head, b->p, n);
  if (b->size >= 16) memcpy(&tail, (char *)b->p + b->size - 8, 8);
  return memcmp(&head, &b->cookie, n) == 0 && tail == b->cookie;
}

/* ---- workers ----------------------------------------------------------------------------- */

int nthreads, ndevices;
int collects;
long ops_per_thread;
uint64_t seed;
mailbox_t mailboxes[MAX_THREADS];
atomic_int workers_done;
atomic_long n_malloc, n_free, n_handed, n_bad, n_record, n_hold, n_pooled, n_pool_releases, n_ranges;

/* Releases `pool` on every device (a pool never used on a device releases nothing there). */
static void release_pool_everywhere(uint64_t pool) {
  for (int d = 0; d < ndevices; d++) EXPECT_STATUS(gpupool_release_pool(d, pool), GPUPOOL_SUCCESS);
  atomic_fetch_add(&n_pool_releases, 1);
}

static size_t draw_size(uint64_t *rng) {
  uint64_t r = below(rng, 1000);
  if (r < 700) return 1 + (size_t)below(rng, 16384);
  if (r < 900) return 16384 + (size_t)below(rng, MIB - 16384);
  if (r < 990) return MIB + (size_t)below(rng, 7 * MIB);
  return 8 * MIB + (size_t)below(rng, 16 * MIB);
}

/* Frees a block this thread holds (its own, or one handed to it), checking its cookie first;
 * `check_after`: then free it again, and name it to record_stream, which must both fail. */
static void free_block(const block_t *b, int check_after) {
  if (!stamped(b)) fail("block %p (%zu bytes) was overwritten while live", b->p, b->size);
  if (check_after) pthread_rwlock_rdlock(&cache_lock);
  if (b->tracked) {
    pthread_mutex_lock(&index_lock);
    index_free((uintptr_t)b->p, b->side_uses);
    pthread_mutex_unlock(&index_lock);
  }
  EXPECT_STATUS(gpupool_free(b->p), GPUPOOL_SUCCESS);
  if (check_after) {
    /* Only this thread allocates on its own streams, and no segment is returned to the driver
     * meanwhile (cache_lock; the caller does not ask when garbage collection may return one):
     * nothing can have been handed out at this address since. */
    EXPECT_STATUS(gpupool_free(b->p), GPUPOOL_ERROR_INVALID_POINTER);
    EXPECT_STATUS(gpupool_record_stream(b->p, side_stream(0)), GPUPOOL_ERROR_INVALID_POINTER);
    pthread_rwlock_unlock(&cache_lock);
    atomic_fetch_add(&n_bad, 2);
  }
  atomic_fetch_add(&n_free, 1);
}

void drain_mailbox(int t) {
  block_t got[MAILBOX_CAP];
  pthread_mutex_lock(&mailboxes[t].lock);
  int n = mailboxes[t].n;
  memcpy(got, mailboxes[t].blocks, (size_t)n * sizeof got[0]);
  mailboxes[t].n = 0;
  pthread_mutex_unlock(&mailboxes[t].lock);
  for (int i = 0; i < n; i++) free_block(&got[i], 0);
}

static int hand_to(int t, const block_t *b) {
  int ok = 0;
  pthread_mutex_lock(&mailboxes[t].lock);
  if (mailboxes[t].n < MAILBOX_CAP) {
    mailboxes[t].blocks[mailboxes[t].n++] = *b;
    ok = 1;
  }
  pthread_mutex_unlock(&mailboxes[t].lock);
  return ok;
}

/* The mapped range around a byte of a live block, as a transport asks for it to register
 * (gpupool_segment_mapped_range), with a dma-buf one time in four: the block lies wholly in
 * the range, the range in its segment, on the block's device; while other threads allocate,
 * free and empty the cache around it. */
static void mapped_range(uint64_t *rng, const block_t *b) {
  const char *inside = (const char *)b->p + below(rng, b->size);
  gpupool_mapped_range_t r;
  memset(&r, 0, sizeof r);
  int fd = -1, with_fd = below(rng, 4) == 0;
  gpupool_status st = gpupool_segment_mapped_range(inside, &r, with_fd ? &fd : NULL);
  atomic_fetch_add(&n_ranges, 1);
  if (st != GPUPOOL_SUCCESS) {
    fail("gpupool_segment_mapped_range(%p, a live block of %zu bytes at %p) returned %s: %s", (const void *)inside,
         b->size, b->p, gpupool_status_string(st), gpupool_last_error_message());
    return;
  }
  uintptr_t p = (uintptr_t)b->p, a = (uintptr_t)r.address, s = (uintptr_t)r.segment_address;
  if (a > p || p + b->size > a + r.bytes || s > a || a + r.bytes > s + r.segment_bytes || r.device != b->device)
    fail("gpupool_segment_mapped_range: block %#" PRIxPTR " (%zu bytes, device %d) outside its range %#" PRIxPTR
         " (%zu bytes) of segment %#" PRIxPTR " (%zu bytes, device %d)",
         p, b->size, b->device, a, r.bytes, s, r.segment_bytes, r.device);
  if (with_fd) {
    if (fd < 0) fail("gpupool_segment_mapped_range: no dma-buf descriptor");
    else close(fd);
  }
}

void *worker(void *arg) {
  int t = (int)(intptr_t)arg;
  uint64_t rng = seed ^ (UINT64_C(0x9e3779b97f4a7c15) * (uint64_t)(t + 1));
  if (!rng) rng = 1;
  block_t live[LIVE_CAP];
  int nlive = 0;
  uint64_t counter = 0;
  uint64_t pool = 0;
  EXPECT_STATUS(gpupool_pool_create(&pool), GPUPOOL_SUCCESS);
  int routed = -1; /* the device whose allocations this thread routes to `pool`, or -1 */
  pinned_t pinned[PINNED_CAP];
  int npinned = 0;
  uint64_t pinned_counter = 0;
  for (long i = 0; i < ops_per_thread; i++) {
    uint64_t r = below(&rng, 1000);
    if (below(&rng, 8) == 0) drain_mailbox(t);
    if (below(&rng, 10) == 0) pinned_op(t, &rng, pinned, &npinned, &pinned_counter);
    if (below(&rng, 64) == 0) {
      /* Begin or end the route to the thread's pool; now and then release the pool. */
      if (routed >= 0) {
        EXPECT_STATUS(gpupool_end_allocate_to_pool(routed, pool), GPUPOOL_SUCCESS);
        routed = -1;
        if (below(&rng, 4) == 0) {
          release_pool_everywhere(pool);
          EXPECT_STATUS(gpupool_pool_create(&pool), GPUPOOL_SUCCESS);
        }
      } else {
        routed = (int)below(&rng, (uint64_t)ndevices);
        EXPECT_STATUS(gpupool_begin_allocate_to_pool_thread(routed, pool), GPUPOOL_SUCCESS);
      }
    }
    /* Snapshots from the workers too, so that even when the statistics thread gets little CPU
     * the statistics are read while other threads are in the middle of their calls. */
    if ((i & 63) == 63) check_snapshot((int)below(&rng, (uint64_t)ndevices));
    if ((i & 127) == 64) {
      /* One of the thread's own streams retired, as before cudaStreamDestroy, while the other
       * threads allocate, free and sleep: its work waited for at most (its blocks stay as they
       * are; the stream is used again after, as a new stream given the handle would be). */
      int waited = -1;
      EXPECT_STATUS(gpupool_stream_retire((int)below(&rng, (uint64_t)ndevices), own_stream(t, (int)below(&rng, OWN_STREAMS)),
                                          &waited),
                    GPUPOOL_SUCCESS);
      if (waited != 0 && waited != 1) fail("gpupool_stream_retire wrote %d to waited", waited);
    }
    if (r < 4) {
      /* Hold or release a side stream. */
      int k = (int)below(&rng, SIDE_STREAMS);
      pthread_mutex_lock(&index_lock);
      int held = (held_mask >> k) & 1;
      pthread_mutex_unlock(&index_lock);
      if (held)
        release_side(k);
      else
        hold_side(k);
      atomic_fetch_add(&n_hold, 1);
    } else if (r < 6) {
      /* A pointer gpupool never handed out. */
      int local = 0;
      EXPECT_STATUS(gpupool_free(&local), GPUPOOL_ERROR_INVALID_POINTER);
      atomic_fetch_add(&n_bad, 1);
    } else if (nlive < 4 || (r < 560 && nlive < LIVE_CAP)) {
      block_t b;
      memset(&b, 0, sizeof b);
      b.size = draw_size(&rng);
      b.own = below(&rng, 5) != 0;
      b.stream = b.own ? own_stream(t, (int)below(&rng, OWN_STREAMS)) : side_stream((int)below(&rng, SIDE_STREAMS));
      int device = (int)below(&rng, (uint64_t)ndevices);
      b.p = NULL;
      gpupool_status st = gpupool_malloc(&b.p, b.size, device, b.stream);
      atomic_fetch_add(&n_malloc, 1);
      if (st != GPUPOOL_SUCCESS || !b.p) {
        fail("gpupool_malloc(%zu bytes, device %d) returned %s: %s", b.size, device,
             gpupool_status_string(st), gpupool_last_error_message());
        continue;
      }
      b.device = device;
      b.pooled = device == routed;
      if (b.pooled) atomic_fetch_add(&n_pooled, 1);
      b.cookie = ((uint64_t)(t + 1) << 48) | ++counter;
      pthread_mutex_lock(&index_lock);
      b.tracked = index_add((uintptr_t)b.p, b.size, b.stream);
      pthread_mutex_unlock(&index_lock);
      stamp(&b);
      if (below(&rng, 6) == 0) {
        /* Used on other streams too: a side stream (perhaps held), another thread's stream,
         * or the NULL stream. */
        int uses = 1 + (int)below(&rng, MAX_USES);
        for (int u = 0; u < uses; u++) {
          uint64_t which = below(&rng, 3);
          gpupool_stream_t s;
          if (which == 0) {
            int k = (int)below(&rng, SIDE_STREAMS);
            s = side_stream(k);
            if (s != b.stream) b.side_uses |= 1u << k;
          } else if (which == 1) {
            s = own_stream((int)below(&rng, (uint64_t)nthreads), (int)below(&rng, OWN_STREAMS));
          } else {
            s = NULL;
          }
          EXPECT_STATUS(gpupool_record_stream(b.p, s), GPUPOOL_SUCCESS);
          atomic_fetch_add(&n_record, 1);
        }
      }
      live[nlive++] = b;
    } else {
      int k = (int)below(&rng, (uint64_t)nlive);
      block_t b = live[k];
      uint64_t what = below(&rng, 100);
      if (what < 5 && b.size >= 2) {
        /* Inside a live block: refused, nothing changes (the cookie is checked at the free). */
        char *inside = (char *)b.p + 1 + below(&rng, b.size - 1);
        EXPECT_STATUS(gpupool_free(inside), GPUPOOL_ERROR_INVALID_POINTER);
        EXPECT_STATUS(gpupool_record_stream(inside, side_stream(1)), GPUPOOL_ERROR_INVALID_POINTER);
        atomic_fetch_add(&n_bad, 2);
        continue;
      }
      if (what < 9) {
        mapped_range(&rng, &b);
        continue;
      }
      live[k] = live[--nlive];
      if (what < 15 && nthreads > 1) {
        int to = (t + 1 + (int)below(&rng, (uint64_t)(nthreads - 1))) % nthreads;
        if (hand_to(to, &b)) {
          atomic_fetch_add(&n_handed, 1);
          continue;
        }
      }
      free_block(&b, b.own && !b.pooled && what >= 80 && !collects);
    }
  }
  if (routed >= 0) EXPECT_STATUS(gpupool_end_allocate_to_pool(routed, pool), GPUPOOL_SUCCESS);
  release_pool_everywhere(pool);
  for (int i = 0; i < nlive; i++) free_block(&live[i], 0);
  for (int i = 0; i < npinned; i++) pinned_free(&pinned[i]);
  atomic_fetch_add(&workers_done, 1);
  return NULL;
}

