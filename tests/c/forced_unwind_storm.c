/* The storm of test_forced_unwind.c (forced_unwind_storm.h): waves of threads allocating and
 * freeing on shared streams, which test_forced_unwind.c's segment observer ends at random
 * (exit or cancellation) at some growth or release; the cookies of every block they held are
 * checked afterwards. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "gpupool.h"
#include "check.h"
#include "forced_unwind_storm.h"

#define MIB ((size_t)1 << 20)

/* The storm's threads (at the end): each event told to one of them ends it now and then. */
_Thread_local int storm_thread;
static _Thread_local uint64_t storm_rng;
static volatile int storm_ended;
uint64_t next_random(void) {
  storm_rng ^= storm_rng << 13, storm_rng ^= storm_rng >> 7, storm_rng ^= storm_rng << 17;
  return storm_rng;
}

void storm_count_end(void) { __atomic_add_fetch(&storm_ended, 1, __ATOMIC_SEQ_CST); }

/* A storm thread's blocks, each with a cookie at both ends: what it still holds when it ends
 * (inside gpupool or not) is the main thread's to check and free. */
#define STORM_THREADS 8
#define STORM_HELD 16
struct storm {
  int id;
  void *held[STORM_HELD];
  size_t size[STORM_HELD];
  int returned;
};

static uint64_t cookie(const struct storm *s, int slot) { return 0x9e3779b97f4a7c15ull * (uint64_t)(s->id * 64 + slot + 1); }

static int cookie_intact(const struct storm *s, int slot) {
  const uint64_t *head = s->held[slot];
  const uint64_t *tail = (const uint64_t *)((const char *)s->held[slot] + s->size[slot] - 8);
  return *head == cookie(s, slot) && *tail == cookie(s, slot);
}

/* Allocates and frees on four streams shared by the threads, blocks of 64 KiB to 6 MiB (many
 * grow a segment), and now and then gives the cache back: its segment observer ends it at some
 * growth or release. */
static void *storm_worker(void *arg) {
  struct storm *s = arg;
  storm_thread = 1;
  storm_rng = 0x2545f4914f6cdd1dull * (uint64_t)(s->id + 1);
  for (int i = 0; i < 200; i++) {
    int slot = (int)(next_random() % STORM_HELD);
    if (s->held[slot] != NULL) {
      if (!cookie_intact(s, slot)) __atomic_add_fetch(&checks_failed, 1, __ATOMIC_SEQ_CST);
      void *p = s->held[slot];
      s->held[slot] = NULL;
      if (gpupool_free(p) != GPUPOOL_SUCCESS) __atomic_add_fetch(&checks_failed, 1, __ATOMIC_SEQ_CST);
    }
    size_t size = ((size_t)1 << (16 + next_random() % 7)) + next_random() % MIB;
    void *p = NULL;
    gpupool_stream_t stream = (gpupool_stream_t)(uintptr_t)(0x1000 * (1 + s->id % 4));
    if (gpupool_malloc(&p, size, 0, stream) == GPUPOOL_SUCCESS) {
      s->size[slot] = size;
      s->held[slot] = p;
      *(uint64_t *)p = cookie(s, slot);
      *(uint64_t *)((char *)p + size - 8) = cookie(s, slot);
    }
    if (i % 25 == 24) gpupool_empty_cache(0);
  }
  s->returned = 1;
  return NULL;
}

/* Waves of storm threads; what each ended thread held is checked and freed afterwards. */
void storm(int waves, int *failed, int *passed) {
  int ended = 0;
  for (int w = 0; w < waves; w++) {
    struct storm s[STORM_THREADS];
    pthread_t t[STORM_THREADS];
    memset(s, 0, sizeof s);
    for (int i = 0; i < STORM_THREADS; i++) {
      s[i].id = w * STORM_THREADS + i;
      CHECK(pthread_create(&t[i], NULL, storm_worker, &s[i]) == 0);
    }
    for (int i = 0; i < STORM_THREADS; i++) {
      CHECK(pthread_join(t[i], NULL) == 0);
      ended += !s[i].returned;
      for (int slot = 0; slot < STORM_HELD; slot++) {
        if (s[i].held[slot] == NULL) continue;
        CHECK(cookie_intact(&s[i], slot));
        CHECK_OK(gpupool_free(s[i].held[slot]));
      }
    }
  }
  printf("storm: %d threads, %d ended inside gpupool (%d ends asked for)\n", waves * STORM_THREADS, ended,
         storm_ended);
  CHECK(ended > 0);
  *failed += checks_failed;
  *passed += checks_passed;
}

