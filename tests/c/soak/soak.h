/* The soak's parts, shared by its files (test_soak.c says what the soak does and checks):
 *   soak_index.c    errors, and the index of live and quarantined ranges, held side streams,
 *                   empty_cache under the workers' lock
 *   soak_worker.c   the workers: blocks and cookies, mailboxes, record_stream, private pools,
 *                   bad pointers, the mapped ranges transports ask for
 *   soak_pinned.c   pinned host memory
 *   soak_stats.c    the statistics' checks and the thread that reads them in a loop
 *   soak_sleeper.c  the sleeper: a sleepable pool put to sleep and woken while the workers run
 *   test_soak.c     main: the threads, then the checks once everything is freed */
#ifndef GPUPOOL_SOAK_H
#define GPUPOOL_SOAK_H

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

/* ---- errors (soak_index.c) --------------------------------------------------------------- */

extern atomic_long errors;
/* Counts an error and prints the first 30. */
void fail(const char *fmt, ...);

#define EXPECT_STATUS(call, want)                                                             \
  do {                                                                                        \
    gpupool_status got_ = (call);                                                             \
    if (got_ != (want))                                                                       \
      fail("%s:%d: %s returned %s, expected %s (%s)", __FILE__, __LINE__, #call,              \
           gpupool_status_string(got_), gpupool_status_string(want),                          \
           gpupool_last_error_message());                                                     \
  } while (0)

/* ---- deterministic random numbers -------------------------------------------------------- */

static inline uint64_t next(uint64_t *s) {
  /* xorshift64* */
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * UINT64_C(2685821657736338717);
}

static inline uint64_t below(uint64_t *s, uint64_t n) { return next(s) % n; }

/* ---- streams ----------------------------------------------------------------------------- */

static inline gpupool_stream_t own_stream(int thread, int k) {
  return (gpupool_stream_t)(uintptr_t)(0x100000u * (unsigned)(thread + 1) + 0x10u * (unsigned)(k + 1));
}

static inline gpupool_stream_t side_stream(int k) {
  return (gpupool_stream_t)(uintptr_t)(0x7000000u + 0x10u * (unsigned)(k + 1));
}

/* ---- blocks, mailboxes and the workers (soak_worker.c) ---------------------------------- */

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
  int device;
} block_t;

typedef struct {
  pthread_mutex_t lock;
  block_t blocks[MAILBOX_CAP];
  int n;
} mailbox_t;

extern int nthreads, ndevices;
/* garbage_collection_threshold is set: another thread's malloc may give a whole free segment
 * back to the driver, outside cache_lock, and the driver may hand its addresses out again. */
extern int collects;
extern long ops_per_thread;
extern uint64_t seed;
extern mailbox_t mailboxes[MAX_THREADS];
extern atomic_int workers_done;
extern atomic_long n_malloc, n_free, n_handed, n_bad, n_record, n_hold, n_pooled, n_pool_releases, n_ranges;

/* Worker `(intptr_t)arg`: its operations, then frees what it holds. */
void *worker(void *arg);
/* Frees the blocks other threads handed to worker `t`. */
void drain_mailbox(int t);

/* ---- the index (soak_index.c) ------------------------------------------------------------ */

extern pthread_mutex_t index_lock;
/* Side streams held, as the index sees them (changed only with index_lock held). */
extern unsigned held_mask;
/* empty_cache's lock against the workers' double-free checks (soak_index.c says why). */
extern pthread_rwlock_t cache_lock;
/* Adds a block just handed out (index_lock held); 0 and an error if it overlaps. */
int index_add(uintptr_t p, size_t size, gpupool_stream_t stream);
/* The live block at `p` is about to be freed (index_lock held). */
void index_free(uintptr_t p, unsigned side_uses);
/* Ranges in the index, and its memory given back at the end. */
size_t index_size(void);
void index_destroy(void);
void hold_side(int k);
void release_side(int k);
void empty_cache(int device);

/* ---- pinned host memory (soak_pinned.c) -------------------------------------------------- */

#define PINNED_CAP 12
#define PINNED_BOX_CAP 64

typedef struct {
  void *p;
  size_t size;
  uint64_t cookie;
} pinned_t;

extern pinned_t pinned_box[PINNED_BOX_CAP];
extern int npinned_box;
extern atomic_long n_pinned, n_pinned_handed, n_pinned_events;
/* One pinned operation of worker `t` on the blocks it keeps in `mine` (`*n` of them). */
void pinned_op(int t, uint64_t *rng, pinned_t *mine, int *n, uint64_t *counter);
/* Checks a pinned block's cookies and frees it. */
void pinned_free(const pinned_t *b);

/* ---- statistics (soak_stats.c) ----------------------------------------------------------- */

extern atomic_long snapshots;
void check_stat(const char *what, int device, const gpupool_stat_t *s);
/* Reads and checks one snapshot of `device`'s statistics. */
gpupool_stats_t check_snapshot(int device);
void check_host_snapshot(void);
void pause_us(long us);
/* Reads the statistics in a loop until the workers are done; resets peaks, empties caches. */
void *stats_thread(void *arg);

/* ---- the sleeper (soak_sleeper.c) -------------------------------------------------------- */

extern atomic_long n_sleeps, n_wake_retries;
/* Puts a sleepable pool of its own to sleep and wakes it until the workers are done. */
void *sleeper(void *arg);

#endif
