/* fork() while other threads are inside gpupool: the child must get an error that says CUDA
 * does not survive fork (never hang on a lock another thread held at the fork, never get the
 * parent's cached memory), and the parent goes on as before. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpupool.h"
#include "check.h"

static atomic_int stop;

static void *churn(void *arg) {
  gpupool_stream_t stream = (gpupool_stream_t)arg;
  unsigned x = (unsigned)(size_t)arg;
  while (!atomic_load(&stop)) {
    void *p[8];
    for (int i = 0; i < 8; i++) {
      x = x * 1103515245u + 12345u;
      if (gpupool_malloc(&p[i], 512 + (x >> 8) % (4 << 20), 0, stream) != GPUPOOL_SUCCESS) p[i] = NULL;
    }
    for (int i = 0; i < 8; i++) gpupool_free(p[i]);
    gpupool_stats_t s = GPUPOOL_STATS_INIT;
    gpupool_stats(0, &s);
  }
  return NULL;
}

static void *warm, *warm_host;

/* In the child: every call must fail at once with the fork message. Exit 0 if so. */
static int child(void) {
  alarm(10); /* a hang is killed by SIGALRM, which the parent sees */
  /* The parent's blocks, the last each hit path handed out on this thread: never freed here. */
  if (gpupool_free(warm) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE) return 6;
  if (gpupool_host_free(warm_host) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE) return 7;
  void *h = NULL;
  if (gpupool_host_malloc(&h, 4096) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE || h != NULL) return 8;
  void *p = NULL;
  if (gpupool_malloc(&p, 1024, 0, NULL) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE || p != NULL) return 2;
  if (strstr(gpupool_last_error_message(), "fork") == NULL) return 3;
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  if (gpupool_stats(0, &s) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE) return 4;
  if (gpupool_empty_cache(-1) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE) return 5;
  return 0;
}

int main(void) {
  CHECK(gpupool_malloc(&warm, 4096, 0, NULL) == GPUPOOL_SUCCESS);
  CHECK(gpupool_host_malloc(&warm_host, 4096) == GPUPOOL_SUCCESS);
  pthread_t threads[4];
  /* The simulated device takes any stream handle; a real driver takes only live streams, and
   * CU_STREAM_PER_THREAD (2) is each thread's own. */
  const char *driver = getenv("GPUPOOL_DRIVER");
  int sim = driver && strcmp(driver, "sim") == 0;
  for (size_t t = 0; t < 4; t++) pthread_create(&threads[t], NULL, churn, (void *)(sim ? 0x100 * (t + 1) : 2));
  int hung = 0, wrong = 0;
  for (int i = 0; i < 50; i++) {
    pid_t pid = fork();
    if (pid == 0) _exit(child());
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) {
      hung++;
    } else if (WEXITSTATUS(status) != 0) {
      wrong++;
      printf("fork %d: the child's call gave case %d\n", i, WEXITSTATUS(status));
    }
  }
  atomic_store(&stop, 1);
  for (int t = 0; t < 4; t++) pthread_join(threads[t], NULL);
  printf("50 forks: %d children hung, %d answered wrongly\n", hung, wrong);
  CHECK(hung == 0);
  CHECK(wrong == 0);
  /* The parent is unaffected. */
  CHECK(gpupool_free(warm) == GPUPOOL_SUCCESS);
  CHECK(gpupool_host_free(warm_host) == GPUPOOL_SUCCESS);
  void *p;
  CHECK(gpupool_malloc(&p, 1 << 20, 0, NULL) == GPUPOOL_SUCCESS);
  CHECK(gpupool_free(p) == GPUPOOL_SUCCESS);
  return checks_report("fork");
}
