/* Runs this test program again as `argv0 report` (or `argv0 MODE`: child_run) with
 * GPUPOOL_PRELOAD_STATS=on (under the same LD_PRELOAD), and collects what the child writes to
 * stderr: the shim's exit report. Shared by the shim's C tests (test_preload.c,
 * test_preload_dlopen.c, test_preload_streams.c). */
#ifndef GPUPOOL_TEST_CHILD_REPORT_H
#define GPUPOOL_TEST_CHILD_REPORT_H

#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Runs `argv0 mode`; writes the child's stderr into `out` (`cap` bytes, NUL-terminated,
 * truncated beyond) and returns 1 when the child ran and exited 0, else 0. */
static int child_run(const char *argv0, const char *mode, char *out, size_t cap) {
  int fds[2];
  if (cap == 0 || pipe(fds) != 0) return 0;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    setenv("GPUPOOL_PRELOAD_STATS", "on", 1);
    execl("/proc/self/exe", argv0, mode, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t got;
  while (n < cap - 1 && (got = read(fds[0], out + n, cap - 1 - n)) > 0) n += (size_t)got;
  out[n] = '\0';
  close(fds[0]);
  int status = -1;
  return pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* child_run(argv0, "report", out, cap). */
static int child_report(const char *argv0, char *out, size_t cap) { return child_run(argv0, "report", out, cap); }

#endif
