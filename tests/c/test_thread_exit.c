/* gpupool called from pthread-key destructors, which glibc runs at a thread's exit after the
 * thread's TLS destructors: each thread uses gpupool successfully while it runs, and its first
 * failing call happens in the destructor. The thread's error message must then need no
 * allocation and no exit handler, or it leaks once per thread; CTest runs this under
 * valgrind --leak-check=full --error-exitcode=1 when valgrind is installed. The destructor
 * also allocates on a stream the thread never used, whose shard main's empty_cache takes out
 * of the table: a strong count of it that the thread's shard cache lost would keep it for
 * good. Run with GPUPOOL_DRIVER=sim (or cuda on a GPU). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "check.h"

#define THREADS 8
#define ROUNDS 3

static pthread_key_t key;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* A message, copied: the next failing call on the thread overwrites it. */
struct outcome {
  gpupool_status status;
  char message[160];
};

static struct outcome outcome(gpupool_status status) {
  struct outcome o;
  o.status = status;
  strncpy(o.message, gpupool_last_error_message(), sizeof o.message - 1);
  o.message[sizeof o.message - 1] = '\0';
  return o;
}

static void at_thread_exit(void *arg) {
  int local = 0, count = 0;
  void *p = (void *)0x1;
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  struct outcome freed = outcome(gpupool_free(&local)); /* this thread's first failing call */
  struct outcome null_out = outcome(gpupool_malloc(NULL, 64, 0, NULL));
  struct outcome bad_device = outcome(gpupool_malloc(&p, 64, 1000, NULL));
  struct outcome stats_null = outcome(gpupool_stats(0, NULL));
  gpupool_status counted = gpupool_device_count(&count);
  gpupool_status stats = gpupool_stats(0, &s);
  gpupool_status free_null = gpupool_free(NULL);
  void *q = NULL;
  gpupool_status allocated = gpupool_malloc(&q, 4096, 0, NULL);
  gpupool_status released = allocated == GPUPOOL_SUCCESS ? gpupool_free(q) : allocated;
  /* The simulated device takes any handle; on a GPU, the per-thread default stream. */
  const char *driver = getenv("GPUPOOL_DRIVER");
  gpupool_stream_t fresh = driver && strcmp(driver, "sim") == 0 ? (gpupool_stream_t)0x7100 : (gpupool_stream_t)2;
  void *r = NULL;
  gpupool_status fresh_allocated = gpupool_malloc(&r, 4096, 0, fresh);
  gpupool_status fresh_released = fresh_allocated == GPUPOOL_SUCCESS ? gpupool_free(r) : fresh_allocated;

  pthread_mutex_lock(&lock); /* check.h's counters are shared */
  CHECK((uintptr_t)arg == 1);
  CHECK(freed.status == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strncmp(freed.message, "gpupool_free: ", 14) == 0);
  CHECK(strstr(freed.message, "not allocated by gpupool") != NULL);
  CHECK(null_out.status == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strcmp(null_out.message, "gpupool_malloc: ptr is NULL; it must point to storage for the result") == 0);
  CHECK(bad_device.status == GPUPOOL_ERROR_INVALID_VALUE && p == (void *)0x1);
  CHECK(strncmp(bad_device.message, "gpupool_malloc: ", 16) == 0);
  CHECK(strstr(bad_device.message, "out of range") != NULL);
  CHECK(stats_null.status == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strcmp(stats_null.message, "gpupool_stats: out is NULL; it must point to storage for the result") == 0);
  CHECK(counted == GPUPOOL_SUCCESS && count >= 1);
  CHECK(stats == GPUPOOL_SUCCESS && s.size == sizeof s);
  CHECK(free_null == GPUPOOL_SUCCESS);
  CHECK(allocated == GPUPOOL_SUCCESS && released == GPUPOOL_SUCCESS);
  CHECK(fresh_allocated == GPUPOOL_SUCCESS && fresh_released == GPUPOOL_SUCCESS);
  /* Successful calls left the last failure's message as it was. */
  CHECK(strcmp(gpupool_last_error_message(), stats_null.message) == 0);
  pthread_mutex_unlock(&lock);
}

/* Each thread allocates while it runs, successfully, and does not look at its message: the
 * destructor's calls are the first to touch it. */
static void *thread_main(void *arg) {
  pthread_setspecific(key, arg);
  void *p = NULL;
  gpupool_status s = gpupool_malloc(&p, 1000, 0, NULL);
  if (s == GPUPOOL_SUCCESS) s = gpupool_free(p);
  pthread_mutex_lock(&lock);
  CHECK_OK(s);
  pthread_mutex_unlock(&lock);
  return NULL;
}

int main(void) {
  CHECK(pthread_key_create(&key, at_thread_exit) == 0);
  for (int round = 0; round < ROUNDS; round++) {
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) CHECK(pthread_create(&threads[i], NULL, thread_main, (void *)1) == 0);
    for (int i = 0; i < THREADS; i++) CHECK(pthread_join(threads[i], NULL) == 0);
  }
  pthread_key_delete(key);
  /* The main thread's message is its own: no other thread's failures reached it. */
  CHECK(strcmp(gpupool_last_error_message(), "") == 0);
  CHECK_OK(gpupool_empty_cache(-1));
  return checks_report("test_thread_exit");
}
