/* The pinned hit path (src/host/hit.rs) churned from many threads through the C API, on the
 * simulated device: more threads than stripes, in three waves (later threads reuse the thread
 * pointers, so the stripe slots, of earlier ones), allocating sizes of many classes (a few over
 * 1 MiB), freeing their own blocks and each other's, with a cookie in each block to catch one
 * handed out twice, while another thread reads the statistics and empties the cache. Run it
 * under each pinned configuration (CTest sets GPUPOOL_CONF): the background thread, the reserve
 * segment, cuMemHostRegister.
 *
 *   test_host_churn [THREADS [ROUNDS]]      (default 72 and 2000) */
#define _POSIX_C_SOURCE 199309L
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "gpupool.h"
#include "check.h"

#define MAX_THREADS 256
#define SHARED 4096
#define OWN 32

static void *shared[SHARED];
static uint64_t shared_cookie[SHARED];
static int shared_len;
static pthread_mutex_t shared_mu = PTHREAD_MUTEX_INITIALIZER;
static int rounds = 2000;
static volatile int stop;

static uint64_t xorshift(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Frees `p` after checking its cookie; returns the failures. */
static int give_back(void *p, uint64_t cookie) {
  int failures = *(uint64_t *)p != cookie; /* handed out twice: another thread wrote it */
  failures += gpupool_host_free(p) != GPUPOOL_SUCCESS;
  return failures;
}

static void *churn(void *arg) {
  uintptr_t t = (uintptr_t)arg;
  uint64_t rng = 0x9e3779b97f4a7c15ull * (t + 1);
  void *own[OWN];
  uint64_t own_cookie[OWN];
  int n = 0;
  uintptr_t failures = 0;
  for (int i = 0; i < rounds; i++) {
    uint64_t r = xorshift(&rng);
    if (r % 3 == 0 || n == OWN) {
      void *p = NULL;
      uint64_t cookie = 0;
      if ((r >> 8) & 1) {
        pthread_mutex_lock(&shared_mu);
        if (shared_len > 0) {
          shared_len--;
          p = shared[shared_len];
          cookie = shared_cookie[shared_len];
        }
        pthread_mutex_unlock(&shared_mu);
      } else if (n > 0) {
        n--;
        p = own[n];
        cookie = own_cookie[n];
      }
      if (p) failures += give_back(p, cookie);
      continue;
    }
    size_t size = ((r >> 12) & 31) == 0 ? ((size_t)1 << 20) + 4096 : (size_t)8 << ((r >> 16) % 14);
    void *p = NULL;
    if (gpupool_host_malloc(&p, size) != GPUPOOL_SUCCESS || !p) {
      failures++;
      continue;
    }
    uint64_t cookie = (uint64_t)t << 32 | (uint64_t)i;
    *(uint64_t *)p = cookie;
    if ((r >> 24) & 1) {
      pthread_mutex_lock(&shared_mu);
      if (shared_len < SHARED) {
        shared[shared_len] = p;
        shared_cookie[shared_len] = cookie;
        shared_len++;
        p = NULL;
      }
      pthread_mutex_unlock(&shared_mu);
    }
    if (p) {
      own[n] = p;
      own_cookie[n] = cookie;
      n++;
    }
  }
  while (n > 0) {
    n--;
    failures += give_back(own[n], own_cookie[n]);
  }
  return (void *)failures;
}

static void *reader(void *arg) {
  uintptr_t failures = 0;
  (void)arg;
  while (!stop) {
    gpupool_host_stats_t s = GPUPOOL_HOST_STATS_INIT;
    failures += gpupool_host_stats(&s) != GPUPOOL_SUCCESS;
    failures += s.active_requests.current > s.allocations.current;
    failures += s.active_bytes.current > s.allocated_bytes.current;
    failures += s.active_requests.current > s.active_requests.peak;
    failures += gpupool_host_empty_cache() != GPUPOOL_SUCCESS;
    /* Every 100 us: often enough to meet the churn, without starving it under valgrind. */
    struct timespec pause = {0, 100000};
    nanosleep(&pause, NULL);
  }
  return (void *)failures;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 72;
  if (argc > 2) rounds = atoi(argv[2]);
  if (threads < 1 || threads > MAX_THREADS || rounds < 1) return 2;
  pthread_t th[MAX_THREADS], rd;
  void *failures = NULL;
  CHECK(pthread_create(&rd, NULL, reader, NULL) == 0);
  for (uintptr_t wave = 0; wave < 3; wave++) {
    for (int t = 0; t < threads; t++)
      CHECK(pthread_create(&th[t], NULL, churn, (void *)(wave * MAX_THREADS + (uintptr_t)t)) == 0);
    for (int t = 0; t < threads; t++) {
      CHECK(pthread_join(th[t], &failures) == 0);
      CHECK(failures == NULL);
    }
  }
  stop = 1;
  CHECK(pthread_join(rd, &failures) == 0);
  CHECK(failures == NULL);
  for (int k = 0; k < shared_len; k++) CHECK(give_back(shared[k], shared_cookie[k]) == 0);
  /* Every block free: nothing active, every count given back; empty_cache releases all but the
   * reserve segment's blocks, which stay cached. */
  CHECK_OK(gpupool_host_empty_cache());
  gpupool_host_stats_t s = GPUPOOL_HOST_STATS_INIT;
  CHECK_OK(gpupool_host_stats(&s));
  CHECK(s.active_requests.current == 0 && s.active_bytes.current == 0);
  CHECK(s.active_requests.allocated == s.active_requests.freed);
  CHECK(s.active_bytes.allocated == s.active_bytes.freed);
  /* The active peaks are the stripes' peaks summed (an upper bound of the true peak, which
   * may pass allocations' peak with threads on several stripes): not compared with it. */
  CHECK(s.active_requests.peak >= 1 && s.allocations.current <= s.allocations.peak);
  return checks_report("test_host_churn");
}
