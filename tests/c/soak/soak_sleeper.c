/* The soak's sleeper (soak.h, test_soak.c). */
#define _POSIX_C_SOURCE 200809L

#include "soak.h"

/* ---- the sleeper ------------------------------------------------------------------------- */

atomic_long n_sleeps, n_wake_retries;

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

void *sleeper(void *arg) {
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
