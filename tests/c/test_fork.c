/* fork() while other threads are inside gpupool: the child must get an error that says CUDA
 * does not survive fork (never hang on a lock another thread held at the fork, never get the
 * parent's cached memory), and the parent goes on as before. */
#define _DEFAULT_SOURCE
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

/* The first call of a thread, which starts gpupool, and in the parent alone. */
static void *first_call(void *arg) {
  (void)arg;
  void *p = NULL;
  CHECK(gpupool_malloc(&p, 4096, 0, NULL) == GPUPOOL_SUCCESS);
  CHECK(gpupool_free(p) == GPUPOOL_SUCCESS);
  return NULL;
}

/* fork() while another thread is inside gpupool's start (GPUPOOL_SIM_START_DELAY_MS holds the
 * simulated driver's start open): the child must be refused at once, its device and pinned
 * calls alike, not wait for a start that no thread of the child will finish. */
static int during_start(void) {
  /* A child forked from a process that has not used gpupool yet is a process like any other. */
  pid_t before = fork();
  if (before == 0) {
    alarm(10);
    void *p = NULL;
    if (gpupool_malloc(&p, 4096, 0, NULL) != GPUPOOL_SUCCESS || gpupool_free(p) != GPUPOOL_SUCCESS) _exit(2);
    _exit(0);
  }
  int status = 0;
  waitpid(before, &status, 0);
  printf("fork before any use: the child %s %d\n", WIFSIGNALED(status) ? "was killed by signal" : "exited with",
         WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  pthread_t t;
  pthread_create(&t, NULL, first_call, NULL);
  usleep(200 * 1000); /* well inside the start's delay */
  pid_t pid = fork();
  if (pid == 0) {
    alarm(10);
    void *p = NULL;
    if (gpupool_malloc(&p, 4096, 0, NULL) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE) _exit(2);
    if (gpupool_host_malloc(&p, 4096) != GPUPOOL_ERROR_DRIVER_UNAVAILABLE) _exit(3);
    _exit(0);
  }
  waitpid(pid, &status, 0);
  printf("fork during the start: the child %s %d\n", WIFSIGNALED(status) ? "was killed by signal" : "exited with",
         WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  pthread_join(t, NULL);
  return checks_report("fork during the start");
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "during-start") == 0) return during_start();
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
