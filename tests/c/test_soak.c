/* A deterministic soak of the C API on the simulated device (GPUPOOL_DRIVER=sim, whose device
 * memory is host memory: every pointer can be written and read back).
 *
 *   test_soak [OPS [THREADS]]         (or GPUPOOL_SOAK_OPS, GPUPOOL_SOAK_THREADS, GPUPOOL_SOAK_SEED)
 *
 * OPS operations in all (default 1000000), spread over THREADS worker threads (default 8). Each
 * worker draws its operations from its own seeded generator, so the sequence of each thread
 * is the same from run to run (the interleaving is not). A worker allocates on its own three
 * streams and on four shared side streams, on every simulated device; writes a cookie into
 * the first and last bytes of every block and checks it when the block is freed; calls
 * gpupool_record_stream onto other threads' streams, the side streams and the NULL stream;
 * hands blocks to other threads to free; holds and releases side streams
 * (gpupool_sim_hold_stream), so that blocks freed after being used there await their events;
 * frees each block once, and mixes in double frees, frees and record_stream calls of interior
 * and freed pointers and of a stack address, which must all return
 * GPUPOOL_ERROR_INVALID_POINTER and change nothing.
 *
 * Workers also allocate and free pinned host memory (gpupool_host_*): cookies checked at each
 * free, blocks freed by other threads, events named, frees inside a block refused; the pinned
 * statistics are checked with the device's, and at the end every pinned block is free and,
 * after gpupool_host_empty_cache, given back.
 *
 * A shared index of address ranges (a sorted array under a mutex) holds every live block and
 * every freed block whose record_stream events cannot have completed (used on a held side
 * stream, not yet released): a block handed out that overlaps either is an error.
 *
 * Each worker also routes its allocations on one device to a private pool of its own for a
 * while (gpupool_begin_allocate_to_pool_thread, PyTorch's use_mem_pool), ends the route, and
 * now and then releases the pool with blocks of it still live (some in other threads'
 * mailboxes), which then go back to the driver as they are freed, and takes a new pool.
 *
 * With expandable segments (whose growths and shrinks need not pair up, so that the check of
 * segments allocated against freed holds only without them), a sleeper thread keeps a few
 * blocks of its own in a sleepable private pool on device 0, and
 * puts the pool to sleep and wakes it in a loop while the workers run (gpupool_sleep with
 * offload three times in four, once of them into the pinned copy the pool keeps, discard the
 * fourth), while another thread frees a block of the pool at a moment anywhere in the sleep
 * and empties the cache: allocating from the sleeping pool must be
 * refused, and after an offload every byte of its blocks must be back (a wake the device
 * cannot serve yet is retried).
 *
 * A concurrent thread reads gpupool_stats of every device in a loop and checks each snapshot
 * (current <= peak, allocated - freed == current, all == small + large, all.peak <=
 * small.peak + large.peak), and calls gpupool_reset_peak_stats, gpupool_memory_summary,
 * gpupool_largest_allocatable and gpupool_empty_cache; the workers take and check a snapshot
 * every 64 operations too.
 *
 * At the end: everything freed, the cache emptied, every device's reserved, allocation,
 * active and requested figures are 0, and every statistic's allocated - freed == current.
 * Prints "soak: N ops, M threads: E errors" and exits 1 if E > 0 (77, skipped, when another
 * driver than the simulated one is selected). */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpupool.h"
#if defined(__has_include)
#if __has_include("gpupool_testing.h")
#include "gpupool_testing.h"
#endif
#endif

#define MIB ((size_t)1 << 20)
#define MAX_THREADS 64
#define OWN_STREAMS 3
#define SIDE_STREAMS 4
#define LIVE_CAP 48
#define MAILBOX_CAP 64
#define MAX_USES 4

/* ---- errors ------------------------------------------------------------------------------ */

static atomic_long errors;

static void fail(const char *fmt, ...) {
  long n = atomic_fetch_add(&errors, 1);
  if (n >= 30) return; /* the first 30 are enough to see what went wrong */
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "soak: error: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

#define EXPECT_STATUS(call, want)                                                             \
  do {                                                                                        \
    gpupool_status got_ = (call);                                                             \
    if (got_ != (want))                                                                       \
      fail("%s:%d: %s returned %s, expected %s (%s)", __FILE__, __LINE__, #call,              \
           gpupool_status_string(got_), gpupool_status_string(want),                          \
           gpupool_last_error_message());                                                     \
  } while (0)

/* ---- deterministic random numbers -------------------------------------------------------- */

static uint64_t next(uint64_t *s) {
  /* xorshift64* */
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * UINT64_C(2685821657736338717);
}

static uint64_t below(uint64_t *s, uint64_t n) { return next(s) % n; }

/* ---- streams ----------------------------------------------------------------------------- */

static gpupool_stream_t own_stream(int thread, int k) {
  return (gpupool_stream_t)(uintptr_t)(0x100000u * (unsigned)(thread + 1) + 0x10u * (unsigned)(k + 1));
}

static gpupool_stream_t side_stream(int k) {
  return (gpupool_stream_t)(uintptr_t)(0x7000000u + 0x10u * (unsigned)(k + 1));
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

static pthread_mutex_t index_lock = PTHREAD_MUTEX_INITIALIZER;
static range_t *ranges;
static size_t nranges, cap_ranges;
/* Side streams held, as the index sees them (changed only with index_lock held, together
 * with the simulated device's own state). */
static unsigned held_mask;

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

static int index_add(uintptr_t p, size_t size, gpupool_stream_t stream) {
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
static void index_free(uintptr_t p, unsigned side_uses) {
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

static void hold_side(int k) {
  pthread_mutex_lock(&index_lock);
  EXPECT_STATUS(gpupool_sim_hold_stream(side_stream(k)), GPUPOOL_SUCCESS);
  held_mask |= 1u << k;
  pthread_mutex_unlock(&index_lock);
}

static void release_side(int k) {
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
static pthread_rwlock_t cache_lock = PTHREAD_RWLOCK_INITIALIZER;

static void empty_cache(int device) {
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

/* ---- blocks and cookies ------------------------------------------------------------------ */

typedef struct {
  void *p;
  size_t size;
  uint64_t cookie;
  gpupool_stream_t stream;
  int own;          /* allocated on the owner's own stream (only that thread allocates there) */
  int tracked;      /* in the index (not when it clashed) */
  unsigned side_uses; /* side streams named to gpupool_record_stream */
  int pooled;       /* from the thread's private pool, whose segments may go back to the driver
                       as soon as they are wholly free once it is released */
} block_t;

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

typedef struct {
  pthread_mutex_t lock;
  block_t blocks[MAILBOX_CAP];
  int n;
} mailbox_t;

static int nthreads, ndevices;
/* garbage_collection_threshold is set: another thread's malloc may give a whole free segment
 * back to the driver, outside cache_lock, and the driver may hand its addresses out again. */
static int collects;
static long ops_per_thread;
static uint64_t seed;
static mailbox_t mailboxes[MAX_THREADS];
static atomic_int workers_done;
static atomic_long n_malloc, n_free, n_handed, n_bad, n_record, n_hold, n_pooled, n_pool_releases;

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

static void drain_mailbox(int t) {
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

static gpupool_stats_t check_snapshot(int device);

/* ---- pinned host memory ------------------------------------------------------------------ */

/* Each worker keeps up to PINNED_CAP pinned blocks (more than the 8 a stripe's stack of
 * handed-out blocks holds, so that frees also find blocks in its map), with a cookie at both
 * ends checked at the free (a block handed out twice is overwritten by its second owner);
 * names one of its streams for some (gpupool_host_record_event: the free then waits for the
 * event, and the stripe's hit path gives way to the full one); passes blocks to other threads
 * through a shared box, to be freed there; and frees inside a block, which is refused. */
#define PINNED_CAP 12
#define PINNED_BOX_CAP 64

typedef struct {
  void *p;
  size_t size;
  uint64_t cookie;
} pinned_t;

static pthread_mutex_t pinned_box_lock = PTHREAD_MUTEX_INITIALIZER;
static pinned_t pinned_box[PINNED_BOX_CAP];
static int npinned_box;
static atomic_long n_pinned, n_pinned_handed, n_pinned_events;

/* Mostly up to 64 KiB, some up to 1 MiB, a few of the classes above 1 MiB. */
static size_t draw_pinned_size(uint64_t *rng) {
  uint64_t r = below(rng, 100);
  if (r < 70) return 16 + below(rng, 64 << 10);
  if (r < 95) return 16 + below(rng, MIB);
  return MIB + below(rng, 2 * MIB);
}

static void pinned_free(const pinned_t *b) {
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

static void pinned_op(int t, uint64_t *rng, pinned_t *mine, int *n, uint64_t *counter) {
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

/* The pinned statistics, read while the workers run: each of one moment (the call holds
 * every lock of the host allocator), so the blocks in use are among those held. */
static void check_stat(const char *what, int device, const gpupool_stat_t *s);

static void check_host_snapshot(void) {
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

static void *worker(void *arg) {
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

/* ---- the statistics thread --------------------------------------------------------------- */

static atomic_long snapshots;

static void check_stat(const char *what, int device, const gpupool_stat_t *s) {
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

static gpupool_stats_t check_snapshot(int device) {
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

static void pause_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

/* ---- the sleeper ------------------------------------------------------------------------- */

static atomic_long n_sleeps, n_wake_retries;

static void sleeper_fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 131u + seed);
}

static int sleeper_holds(const unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != (unsigned char)(i * 131u + seed)) return 0;
  return 1;
}

/* Frees a block of the sleeping pool while its sleep runs, then empties the cache: the free
 * and the release land anywhere in the sleep, its copies included (issue 40, first defect). */
struct victim {
  void *block;
  long delay_ns;
};

static void *free_during_sleep(void *arg) {
  struct victim *v = arg;
  struct timespec ts = {0, v->delay_ns};
  nanosleep(&ts, NULL);
  EXPECT_STATUS(gpupool_free(v->block), GPUPOOL_SUCCESS);
  /* Through the workers' lock: the segments it returns may come back at the same addresses. */
  empty_cache(0);
  return NULL;
}

static void *sleeper(void *arg) {
  (void)arg;
  enum { N = 4 };
  const size_t size[N] = {3 * MIB, 512, MIB + 7, 64 * 1024};
  unsigned char *p[N];
  gpupool_stream_t s = (gpupool_stream_t)(uintptr_t)0x7100000u;
  uint64_t pool = 0;
  EXPECT_STATUS(gpupool_pool_create_sleepable(&pool), GPUPOOL_SUCCESS);
  EXPECT_STATUS(gpupool_begin_allocate_to_pool_thread(0, pool), GPUPOOL_SUCCESS);
  for (int i = 0; i < N; i++) {
    void *q = NULL;
    EXPECT_STATUS(gpupool_malloc(&q, size[i], 0, s), GPUPOOL_SUCCESS);
    p[i] = q;
    if (q) sleeper_fill(p[i], size[i], (unsigned)i);
  }
  EXPECT_STATUS(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
  for (long round = 0; atomic_load(&workers_done) < nthreads; round++) {
    /* Offload, pinned offload (the copy kept between those rounds), offload, discard. */
    int offload = round % 4 != 3;
    uint32_t mode = round % 4 == 1 ? GPUPOOL_SLEEP_OFFLOAD_PINNED : offload ? GPUPOOL_SLEEP_OFFLOAD : GPUPOOL_SLEEP_DISCARD;
    /* A block beside the kept ones, spanning whole 2 MiB pages, freed by another thread at a
     * moment within the sleep's first 1.5 ms (a sleep of these blocks takes about that on the
     * simulated device). Small: each round copies it twice, and the sleeper runs all along. */
    struct victim v = {NULL, (long)(round * 7919 % 1500000)};
    EXPECT_STATUS(gpupool_begin_allocate_to_pool_thread(0, pool), GPUPOOL_SUCCESS);
    EXPECT_STATUS(gpupool_malloc(&v.block, 6 * MIB, 0, s), GPUPOOL_SUCCESS);
    EXPECT_STATUS(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
    pthread_t freer;
    int freeing = v.block != NULL && pthread_create(&freer, NULL, free_during_sleep, &v) == 0;
    EXPECT_STATUS(gpupool_sleep(0, pool, mode), GPUPOOL_SUCCESS);
    atomic_fetch_add(&n_sleeps, 1);
    void *q = NULL;
    EXPECT_STATUS(gpupool_begin_allocate_to_pool_thread(0, pool), GPUPOOL_SUCCESS);
    EXPECT_STATUS(gpupool_malloc(&q, 256, 0, s), GPUPOOL_ERROR_INVALID_VALUE);
    EXPECT_STATUS(gpupool_end_allocate_to_pool(0, pool), GPUPOOL_SUCCESS);
    gpupool_status st;
    while ((st = gpupool_wake(0, pool)) == GPUPOOL_ERROR_OUT_OF_MEMORY) {
      atomic_fetch_add(&n_wake_retries, 1);
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
    }
    EXPECT_STATUS(st, GPUPOOL_SUCCESS);
    if (freeing) pthread_join(freer, NULL);
    for (int i = 0; i < N && p[i]; i++) {
      if (offload && !sleeper_holds(p[i], size[i], (unsigned)i))
        fail("sleeper: block %d (%zu bytes) differs after an offloaded sleep", i, size[i]);
      if (!offload) sleeper_fill(p[i], size[i], (unsigned)i);
    }
    struct timespec ts = {0, 500000};
    nanosleep(&ts, NULL);
  }
  for (int i = 0; i < N; i++) EXPECT_STATUS(gpupool_free(p[i]), GPUPOOL_SUCCESS);
  EXPECT_STATUS(gpupool_release_pool(0, pool), GPUPOOL_SUCCESS);
  return NULL;
}

static void *stats_thread(void *arg) {
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

/* ---- main -------------------------------------------------------------------------------- */

static long arg_or_env(int argc, char **argv, int i, const char *env, long dflt) {
  const char *v = argc > i ? argv[i] : getenv(env);
  if (!v || !*v) return dflt;
  char *end;
  long n = strtol(v, &end, 10);
  if (*end || n <= 0) {
    fprintf(stderr, "soak: %s=%s is not a positive number\n", env, v);
    exit(2);
  }
  return n;
}

int main(int argc, char **argv) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver && *driver && strcmp(driver, "sim") != 0) {
    printf("soak: skipped: needs the simulated device (GPUPOOL_DRIVER=sim), not %s\n", driver);
    return 77;
  }
  /* Defaults for the simulated device unless the caller set them: the soak's blocks and
   * caches fit many times over (pages are committed only where the cookies are written), so
   * no allocation runs out of memory and takes the release-and-retry path. */
  setenv("GPUPOOL_DRIVER", "sim", 1);
  setenv("GPUPOOL_SIM_CAPACITY", "64GiB", 0);
  setenv("GPUPOOL_SIM_DEVICES", "2", 0);

  long ops = arg_or_env(argc, argv, 1, "GPUPOOL_SOAK_OPS", 1000000);
  nthreads = (int)arg_or_env(argc, argv, 2, "GPUPOOL_SOAK_THREADS", 8);
  seed = (uint64_t)arg_or_env(argc, argv, 3, "GPUPOOL_SOAK_SEED", 1);
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  ops_per_thread = (ops + nthreads - 1) / nthreads;

  int count = 0;
  if (gpupool_device_count(&count) != GPUPOOL_SUCCESS) {
    fprintf(stderr, "soak: gpupool_device_count: %s\n", gpupool_last_error_message());
    return 1;
  }
  ndevices = count < 2 ? count : 2;

  for (int t = 0; t < nthreads; t++) pthread_mutex_init(&mailboxes[t].lock, NULL);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pthread_t workers[MAX_THREADS], stats, sleep_thread;
  char conf0[1024];
  size_t needed0 = 0;
  EXPECT_STATUS(gpupool_config_string(conf0, sizeof conf0, &needed0), GPUPOOL_SUCCESS);
  collects = strstr(conf0, "garbage_collection_threshold") != NULL;
  const int sleeps = strstr(conf0, "expandable_segments:True") != NULL;
  if (pthread_create(&stats, NULL, stats_thread, NULL) != 0) return 2;
  if (sleeps && pthread_create(&sleep_thread, NULL, sleeper, NULL) != 0) return 2;
  for (int t = 0; t < nthreads; t++)
    if (pthread_create(&workers[t], NULL, worker, (void *)(intptr_t)t) != 0) return 2;
  for (int t = 0; t < nthreads; t++) pthread_join(workers[t], NULL);
  pthread_join(stats, NULL);
  if (sleeps) pthread_join(sleep_thread, NULL);
  for (int t = 0; t < nthreads; t++) drain_mailbox(t);
  for (int k = 0; k < SIDE_STREAMS; k++) release_side(k);
  for (int i = 0; i < npinned_box; i++) pinned_free(&pinned_box[i]);
  npinned_box = 0;
  clock_gettime(CLOCK_MONOTONIC, &t1);

  /* Everything is freed: after empty_cache nothing may be left. */
  empty_cache(-1);
  char conf[1024];
  size_t needed = 0;
  EXPECT_STATUS(gpupool_config_string(conf, sizeof conf, &needed), GPUPOOL_SUCCESS);
  const int expandable = strstr(conf, "expandable_segments:True") != NULL;
  if (nranges != 0) fail("%zu ranges left in the index after everything was freed", nranges);
  for (int d = 0; d < ndevices; d++) {
    gpupool_stats_t s = check_snapshot(d);
    const struct {
      const char *name;
      int64_t current;
    } zero[] = {
        {"reserved_bytes.all", s.reserved_bytes.all.current},
        {"segment.all", s.segment.all.current},
        {"allocation.all", s.allocation.all.current},
        {"allocated_bytes.all", s.allocated_bytes.all.current},
        {"active.all", s.active.all.current},
        {"active_bytes.all", s.active_bytes.all.current},
        {"requested_bytes.all", s.requested_bytes.all.current},
        {"inactive_split.all", s.inactive_split.all.current},
        {"oversize_allocations", s.oversize_allocations.current},
    };
    for (size_t i = 0; i < sizeof zero / sizeof zero[0]; i++)
      if (zero[i].current != 0)
        fail("device %d: %s.current is %" PRId64 " after everything was freed and the cache emptied", d,
             zero[i].name, zero[i].current);
    if (s.num_alloc_retries != 0 || s.num_ooms != 0)
      fail("device %d: %" PRId64 " retries and %" PRId64 " out-of-memory errors: raise GPUPOOL_SIM_CAPACITY", d,
           s.num_alloc_retries, s.num_ooms);
    /* Every byte obtained from the driver went back. With ordinary segments, also every
     * segment; an expandable segment's growths and shrinks (num_device_alloc, num_device_free,
     * as PyTorch counts them) need not pair up. */
    if (s.reserved_bytes.all.allocated != s.reserved_bytes.all.freed)
      fail("device %d: %" PRId64 " bytes reserved but %" PRId64 " given back", d, s.reserved_bytes.all.allocated,
           s.reserved_bytes.all.freed);
    if (!expandable && s.num_device_alloc != s.num_device_free)
      fail("device %d: %" PRId64 " segments allocated but %" PRId64 " freed", d, s.num_device_alloc,
           s.num_device_free);
  }
  /* Every pinned block freed: after the host's empty_cache (which polls the events of those a
   * stream was named for) none is in use, and none is held but the reserve segment's. */
  EXPECT_STATUS(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
  gpupool_host_stats_t h = GPUPOOL_HOST_STATS_INIT;
  EXPECT_STATUS(gpupool_host_stats(&h), GPUPOOL_SUCCESS);
  if (h.active_requests.current != 0 || h.active_bytes.current != 0)
    fail("host: %" PRId64 " blocks (%" PRId64 " bytes) still in use after everything was freed",
         h.active_requests.current, h.active_bytes.current);
  if (!strstr(conf, "pinned_reserve_segment_size_mb") && (h.allocations.current != 0 || h.allocated_bytes.current != 0))
    fail("host: %" PRId64 " blocks (%" PRId64 " bytes) still pinned after gpupool_host_empty_cache",
         h.allocations.current, h.allocated_bytes.current);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  printf("soak: %ld mallocs (%ld from private pools, %ld pools released), %ld frees (%ld by another thread), "
         "%ld record_stream, %ld holds/releases, %ld refused bad pointers, %ld statistics snapshots, %.2f s\n",
         atomic_load(&n_malloc), atomic_load(&n_pooled), atomic_load(&n_pool_releases), atomic_load(&n_free),
         atomic_load(&n_handed), atomic_load(&n_record), atomic_load(&n_hold), atomic_load(&n_bad),
         atomic_load(&snapshots), secs);
  printf("soak: %ld pinned mallocs (%ld freed by another thread, %ld with an event)\n", atomic_load(&n_pinned),
         atomic_load(&n_pinned_handed), atomic_load(&n_pinned_events));
  /* Every kind of operation ran, however few the operations (CTest runs the variants and
   * valgrind with fewer than the default): a count of 0 means a kind went untested. */
  const struct {
    const char *what;
    long n;
  } kinds[] = {
      {"mallocs", atomic_load(&n_malloc)},
      {"mallocs from private pools", atomic_load(&n_pooled)},
      {"pools released", atomic_load(&n_pool_releases)},
      {"frees", atomic_load(&n_free)},
      {"frees by another thread", atomic_load(&n_handed)},
      {"record_stream calls", atomic_load(&n_record)},
      {"holds and releases of side streams", atomic_load(&n_hold)},
      {"bad pointers refused", atomic_load(&n_bad)},
      {"statistics snapshots", atomic_load(&snapshots)},
      {"pinned mallocs", atomic_load(&n_pinned)},
      {"pinned blocks freed by another thread", atomic_load(&n_pinned_handed)},
      {"pinned blocks with an event", atomic_load(&n_pinned_events)},
  };
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
    if (kinds[i].n == 0) fail("no %s: too few operations to cover every kind", kinds[i].what);
  printf("soak: %ld sleeps and wakes of a pool (%ld wakes retried for memory)\n", atomic_load(&n_sleeps),
         atomic_load(&n_wake_retries));
  /* Each of the sleeper's modes (offload, pinned, offload, discard) at least once. */
  if (sleeps && atomic_load(&n_sleeps) < 4) fail("the sleeper slept its pool %ld times, not every mode", atomic_load(&n_sleeps));
  long e = atomic_load(&errors);
  printf("soak: %ld ops, %d threads: %ld errors\n", ops_per_thread * nthreads, nthreads, e);
  free(ranges);
  return e == 0 ? 0 : 1;
}
