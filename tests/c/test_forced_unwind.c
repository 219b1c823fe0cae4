/* A thread that ends inside gpupool (issue 40, defect 8): pthread_exit from inside an
 * out-of-memory observer and inside segment observers, a thread cancelled at
 * pthread_testcancel inside an observer, and a cancellation that arrives while gpupool runs
 * code of its own (which must wait for gpupool to return). glibc ends a thread with a forced
 * unwind; gpupool's entry points used to catch it as a panic and abort the process ("FATAL:
 * exception not rethrown"). Each time here the thread must end as the program asked (its
 * pthread_cleanup_push handler run, pthread_join given its value or PTHREAD_CANCELED), and the
 * process go on: no lock left held (the next calls, from another thread, do not hang: an alarm
 * fails the test if they do), observers detachable, the statistics exact (the block of a malloc
 * whose thread ended is not counted as allocated), and memory all given back at the end. Last,
 * a storm: waves of threads allocating and freeing on shared streams, ended at random inside
 * their segment observers (exit or cancellation), the cookies of every block intact.
 * On the simulated device of 1 GiB (GPUPOOL_DRIVER=sim). */
#define _POSIX_C_SOURCE 200809L /* posix_memalign */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpupool.h"
#include "gpupool_testing.h"
#include "check.h"
#include "forced_unwind_storm.h"

#define MIB ((size_t)1 << 20)

static int64_t allocated(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s.allocated_bytes.all.current;
}

static int64_t reserved(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s.reserved_bytes.all.current;
}

static int64_t num_ooms(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  return s.num_ooms;
}

/* The thread the observers end; the others' calls pass through them untouched. */
static pthread_t victim;
static volatile int victim_set;
/* Set by the victim once its warm-up is done: the observers end it from then on. */
static volatile int armed;
/* How the observers end it: 'x' pthread_exit, 'c' pthread_testcancel (cancelled already). */
static volatile char how;
/* What the observers do before: 'm' a nested malloc that grows (whose own observer ends the
 * thread), 's' read the statistics. */
static volatile char nested;
static volatile int ended_inside;

static int is_victim(void) { return armed && victim_set && pthread_equal(pthread_self(), victim); }

static void end_thread(void) {
  ended_inside++;
  if (how == 'x') pthread_exit((void *)(intptr_t)7);
  pthread_testcancel();
  fprintf(stderr, "test_forced_unwind: pthread_testcancel returned in a cancelled thread\n");
  checks_failed++;
}

static void oom_observer(int device, size_t requested, const gpupool_stats_t *stats, void *user) {
  (void)device, (void)requested, (void)stats, (void)user;
  if (!is_victim()) return;
  if (nested == 's') {
    gpupool_stats_t s = GPUPOOL_STATS_INIT;
    CHECK_OK(gpupool_stats(0, &s));
  }
  if (nested == 'm') {
    /* Grows a segment: the segment observer ends the thread inside this nested malloc. */
    void *p = NULL;
    gpupool_malloc(&p, 300 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x77);
    fprintf(stderr, "test_forced_unwind: the nested malloc returned\n");
    checks_failed++;
    return;
  }
  end_thread();
}

/* Ends the victim at each event of the kind it is told of: 'a' memory added (ALLOC of an
 * ordinary segment, MAP of an expandable one's pages), 'r' memory taken away (FREE, UNMAP). */
static volatile char segment_kind;
static void segment_observer(void *user, const gpupool_segment_event_t *event) {
  (void)user;
  int adds = event->kind == GPUPOOL_SEGMENT_ALLOC || event->kind == GPUPOOL_SEGMENT_MAP;
  if (storm_thread && next_random() % 30 == 0) {
    storm_count_end();
    if (next_random() % 2) pthread_exit(NULL);
    pthread_cancel(pthread_self());
    pthread_testcancel();
  }
  if (is_victim() && segment_kind == (adds ? 'a' : 'r')) end_thread();
}

/* A pool's segment allocator (the program's memory: host memory on the simulated device), a
 * route's stream filter and a tag function: each ends the victim once armed. */
static int segment_alloc(void *user, size_t bytes, int device, gpupool_stream_t stream, void **ptr) {
  (void)user, (void)device, (void)stream;
  if (is_victim()) end_thread();
  return posix_memalign(ptr, 2 * MIB, bytes) == 0 ? 0 : 1;
}
static void segment_free(void *user, void *ptr, size_t bytes, int device, gpupool_stream_t stream) {
  (void)user, (void)bytes, (void)device, (void)stream;
  free(ptr);
}
static int filter(void *user, gpupool_stream_t stream) {
  (void)user, (void)stream;
  if (is_victim()) end_thread();
  return 1;
}
static void each_tag(const char *name, const gpupool_tag_stats_t *stats, void *user) {
  (void)name, (void)stats;
  if (is_victim()) end_thread();
  (*(int *)user)++;
}
static uint64_t own_pool;
static uint64_t sleeper;

static volatile int handler_ran;
static void handler(void *arg) {
  (void)arg;
  handler_ran++;
}

struct job {
  /* 'o' malloc past the device, 'g' malloc that grows (from a cold path: the thread's first
   * call on the stream), 'h' malloc that grows from the hit path (the stream's shard in the
   * thread's cache), 'e' empty_cache, 'd' dump a snapshot, 'p' malloc routed to a pool whose
   * segment allocator ends the thread, 'f' malloc whose route's filter ends it, 't' a tag
   * function that ends it, 's' a sleep of a pool and 'w' its wake, told to the observers */
  char what;
  int cancel_first;
};

static void *worker(void *arg) {
  struct job *job = arg;
  while (!victim_set) sched_yield();
  void *p = NULL;
  if (job->what == 'h') {
    /* The stream's shard in this thread's cache, and a segment too small for what follows. */
    CHECK_OK(gpupool_malloc(&p, MIB, 0, (gpupool_stream_t)(uintptr_t)0x66));
    CHECK_OK(gpupool_free(p));
    job->what = 'i';
  }
  armed = 1;
  pthread_cleanup_push(handler, NULL);
  if (job->cancel_first) pthread_cancel(pthread_self());
  int tags_seen = 0;
  switch (job->what) {
    case 'p':
      CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, own_pool));
      gpupool_malloc(&p, 3 * MIB, 0, NULL);
      break;
    case 'f':
      gpupool_malloc(&p, 3 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x88);
      break;
    case 't':
      gpupool_for_each_tag(each_tag, &tags_seen);
      break;
    case 's':
      gpupool_sleep(0, sleeper, GPUPOOL_SLEEP_OFFLOAD);
      break;
    case 'w':
      gpupool_wake(0, sleeper);
      break;
    case 'i':
      gpupool_malloc(&p, 300 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x66);
      break;
    case 'o':
      gpupool_malloc(&p, 4096 * MIB, 0, NULL);
      break;
    case 'g':
      gpupool_malloc(&p, 300 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x55);
      break;
    case 'e':
      gpupool_empty_cache(0);
      break;
    case 'd':
      /* Writing a file reaches cancellation points inside gpupool: the cancellation waits for
       * it to return, and acts at the next one. */
      CHECK_OK(gpupool_dump_snapshot("/tmp/gpupool_test_forced_unwind.pickle"));
      handler_ran += 100;
      pthread_testcancel();
      break;
  }
  fprintf(stderr, "test_forced_unwind: job %c went on after its thread's end\n", job->what);
  checks_failed++;
  pthread_cleanup_pop(0);
  return NULL;
}

/* Runs `job` on a thread of its own; returns what pthread_join gives. */
static void *run(struct job job) {
  pthread_t t;
  handler_ran = 0;
  ended_inside = 0;
  victim_set = 0;
  armed = 0;
  CHECK(pthread_create(&t, NULL, worker, &job) == 0);
  victim = t;
  victim_set = 1;
  void *result = NULL;
  CHECK(pthread_join(t, &result) == 0);
  victim_set = 0;
  armed = 0;
  return result;
}

/* The device works from this thread: nothing left locked, the cache and stream reusable. */
static void still_works(const char *after) {
  void *a = NULL, *b = NULL;
  CHECK_OK(gpupool_malloc(&a, 5 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x55));
  CHECK_OK(gpupool_malloc(&b, 3 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x77));
  CHECK_OK(gpupool_free(a));
  CHECK_OK(gpupool_free(b));
  char summary[16384];
  size_t needed = 0;
  CHECK_OK(gpupool_memory_summary(0, summary, sizeof summary, &needed));
  printf("after %s: the device still allocates, summarises and frees\n", after);
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver == NULL || strcmp(driver, "sim") != 0) {
    printf("test_forced_unwind: skipped, the sizes assume GPUPOOL_DRIVER=sim with 1 GiB\n");
    return 77;
  }
  /* A deadlock (a lock left held) fails the test rather than hanging it. */
  alarm(120);
  CHECK_OK(gpupool_attach_oom_observer(oom_observer, NULL));
  CHECK_OK(gpupool_attach_segment_observer(segment_observer, NULL));
  void *keep = NULL;
  CHECK_OK(gpupool_malloc(&keep, MIB, 0, NULL));
  const int64_t base = allocated();

  /* pthread_exit from an out-of-memory observer, after reading the statistics from inside
   * (every observer is called for each event, the thread's end waiting). */
  how = 'x', nested = 's';
  int64_t ooms = num_ooms();
  void *r = run((struct job){'o', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1);
  CHECK(num_ooms() == ooms + 1 && allocated() == base);
  still_works("pthread_exit in an out-of-memory observer");

  /* Cancelled at pthread_testcancel inside the out-of-memory observer. */
  how = 'c', nested = 0;
  r = run((struct job){'o', 1});
  CHECK(r == PTHREAD_CANCELED && handler_ran == 1 && ended_inside >= 1);
  CHECK(num_ooms() == ooms + 2 && allocated() == base);
  still_works("a cancellation in an out-of-memory observer");

  /* pthread_exit from a segment observer told of the growth of the thread's own malloc: the
   * block never reached the thread, so it is given back. */
  CHECK_OK(gpupool_empty_cache(0));
  const int64_t reserved_before = reserved();
  how = 'x', nested = 0;
  segment_kind = 'a';
  r = run((struct job){'g', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1);
  CHECK(allocated() == base);
  CHECK(reserved() > reserved_before); /* the growth itself stays, cached */
  still_works("pthread_exit in a segment observer of a malloc");

  /* Cancelled inside the same observer. */
  CHECK_OK(gpupool_empty_cache(0));
  how = 'c';
  r = run((struct job){'g', 1});
  CHECK(r == PTHREAD_CANCELED && handler_ran == 1 && ended_inside >= 1 && allocated() == base);
  still_works("a cancellation in a segment observer of a malloc");

  /* The same from the hit path: the thread's stream is cached, and its malloc grows. */
  CHECK_OK(gpupool_empty_cache(0));
  how = 'x';
  r = run((struct job){'h', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1 && allocated() == base);
  CHECK_OK(gpupool_empty_cache(0));
  how = 'c';
  r = run((struct job){'h', 1});
  CHECK(r == PTHREAD_CANCELED && handler_ran == 1 && ended_inside >= 1 && allocated() == base);
  still_works("an end in a segment observer of a malloc from the hit path");

  /* A nested malloc inside an out-of-memory observer, whose segment observer ends the thread:
   * the exit goes through the observer and out of the outer malloc. */
  CHECK_OK(gpupool_empty_cache(0));
  how = 'x', nested = 'm';
  segment_kind = 'a';
  ooms = num_ooms();
  r = run((struct job){'o', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1);
  CHECK(allocated() == base && num_ooms() == ooms + 1);
  still_works("pthread_exit in a nested malloc's segment observer");

  /* pthread_exit from a segment observer told of an unmapping, under the shard's lock, in the
   * middle of empty_cache: empty_cache finishes (every free page given back) first. */
  void *grow = NULL;
  CHECK_OK(gpupool_malloc(&grow, 300 * MIB, 0, (gpupool_stream_t)(uintptr_t)0x99));
  CHECK_OK(gpupool_free(grow));
  how = 'x', nested = 0;
  segment_kind = 'r';
  r = run((struct job){'e', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1);
  CHECK(allocated() == base);
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  CHECK(s.reserved_bytes.all.current <= 2 * (int64_t)MIB); /* only `keep`'s page is left */
  still_works("pthread_exit in a segment observer of empty_cache");

  /* The program's segment allocator of a pool the thread's allocations are routed to: the
   * request fails (no segment) and the thread ends out of gpupool_malloc. */
  segment_kind = 0;
  CHECK_OK(gpupool_pool_create_with_allocator(&own_pool, segment_alloc, segment_free, NULL));
  how = 'x', nested = 0;
  ooms = num_ooms();
  r = run((struct job){'p', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1 && allocated() == base);
  CHECK_OK(gpupool_end_allocate_to_pool(0, own_pool));
  CHECK_OK(gpupool_release_pool(0, own_pool));
  still_works("pthread_exit in a pool's segment allocator");

  /* A route's stream filter: the thread is not routed, its block (from the default pools)
   * given back. */
  uint64_t routed = 0;
  CHECK_OK(gpupool_pool_create(&routed));
  CHECK_OK(gpupool_begin_allocate_to_pool_filter(0, routed, filter, NULL));
  how = 'c';
  r = run((struct job){'f', 1});
  CHECK(r == PTHREAD_CANCELED && handler_ran == 1 && ended_inside >= 1 && allocated() == base);
  CHECK_OK(gpupool_end_allocate_to_pool(0, routed));
  CHECK_OK(gpupool_release_pool(0, routed));
  still_works("a cancellation in a route's stream filter");

  /* A tag function: no more tags are told to the thread that ended. */
  CHECK_OK(gpupool_push_tag("forced-unwind"));
  CHECK_OK(gpupool_pop_tag());
  how = 'x';
  r = run((struct job){'t', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside == 1);
  int tags_here = 0;
  CHECK_OK(gpupool_for_each_tag(each_tag, &tags_here));
  CHECK(tags_here >= 1);
  still_works("pthread_exit in a tag function");

  /* A sleep and a wake, told to the observers (pages unmapped, then mapped): each finishes,
   * the pool asleep then awake with its block's bytes, before the thread ends. */
  CHECK_OK(gpupool_pool_create_sleepable(&sleeper));
  CHECK_OK(gpupool_begin_allocate_to_pool_thread(0, sleeper));
  uint64_t *held = NULL;
  CHECK_OK(gpupool_malloc((void **)&held, 4 * MIB, 0, NULL));
  CHECK_OK(gpupool_end_allocate_to_pool(0, sleeper));
  held[0] = 0x5ee9, held[4 * MIB / 8 - 1] = 0xa3a3;
  how = 'x', segment_kind = 'r';
  r = run((struct job){'s', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1);
  CHECK(gpupool_sleep(0, sleeper, GPUPOOL_SLEEP_OFFLOAD) == GPUPOOL_ERROR_INVALID_VALUE); /* asleep already */
  how = 'c', segment_kind = 'a';
  r = run((struct job){'w', 1});
  CHECK(r == PTHREAD_CANCELED && handler_ran == 1 && ended_inside >= 1);
  CHECK(held[0] == 0x5ee9 && held[4 * MIB / 8 - 1] == 0xa3a3);
  CHECK_OK(gpupool_free(held));
  CHECK_OK(gpupool_release_pool(0, sleeper));
  segment_kind = 0;
  still_works("pthread_exit in a sleep's, and a cancellation in a wake's, segment observer");

  /* Panics still stop at the entry point: a driver call that panics (as cudarc does for a
   * function libcuda lacks) gives GPUPOOL_ERROR_INTERNAL, and the thread goes on. */
  const char *grow_call = getenv("GPUPOOL_CONF") != NULL && strstr(getenv("GPUPOOL_CONF"), "expandable_segments:False")
                              ? "cuMemAlloc_v2"
                              : "cuMemCreate";
  CHECK_OK(gpupool_sim_inject_fault(grow_call, 0, GPUPOOL_SIM_FAULT_PANIC));
  void *none = NULL;
  CHECK(gpupool_malloc(&none, 300 * MIB, 0, (gpupool_stream_t)(uintptr_t)0xaa) == GPUPOOL_ERROR_INTERNAL);
  CHECK(none == NULL && allocated() == base);
  size_t pending = 1;
  CHECK_OK(gpupool_sim_clear_faults(&pending));
  CHECK(pending == 0);
  /* A panic in a call whose thread's end was stopped before it: the end goes on all the same. */
  void *grow2 = NULL;
  CHECK_OK(gpupool_malloc(&grow2, 300 * MIB, 0, (gpupool_stream_t)(uintptr_t)0xab));
  CHECK_OK(gpupool_free(grow2));
  const char *release_call = strcmp(grow_call, "cuMemCreate") == 0 ? "cuMemRelease" : "cuMemFree_v2";
  CHECK_OK(gpupool_sim_inject_fault(release_call, 0, GPUPOOL_SIM_FAULT_PANIC));
  how = 'x', segment_kind = 'r';
  r = run((struct job){'e', 0});
  CHECK(r == (void *)(intptr_t)7 && handler_ran == 1 && ended_inside >= 1);
  CHECK_OK(gpupool_sim_clear_faults(&pending));
  CHECK(pending == 0);
  segment_kind = 0;
  still_works("a panic after an end was stopped");

  /* A cancellation pending while gpupool writes a file: gpupool returns first. */
  segment_kind = 0;
  r = run((struct job){'d', 1});
  CHECK(r == PTHREAD_CANCELED && handler_ran == 101);
  remove("/tmp/gpupool_test_forced_unwind.pickle");

  /* A storm: threads allocating and freeing on shared streams, ended at random inside their
   * segment observers; the cookies of every block they held intact, every byte back. */
  storm(6, &checks_failed, &checks_passed);
  CHECK(allocated() == base);
  still_works("the storm");

  /* The observers can be detached (no call of theirs is counted as under way), and every
   * byte comes back. */
  CHECK_OK(gpupool_detach_oom_observer(oom_observer, NULL));
  CHECK_OK(gpupool_detach_segment_observer(segment_observer, NULL));
  CHECK_OK(gpupool_free(keep));
  CHECK_OK(gpupool_empty_cache(0));
  CHECK(allocated() == 0 && reserved() == 0);
  return checks_report("test_forced_unwind");
}
