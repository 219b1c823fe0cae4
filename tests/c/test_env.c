/* How gpupool starts when it cannot: run as `test_env no-driver` on a machine without
 * libcuda (GPUPOOL_DRIVER unset: the CUDA driver is the default), as `test_env partial-driver`
 * with LD_LIBRARY_PATH leading to a libcuda that lacks cuMemAlloc_v2 (stub_libcuda.c), as
 * `test_env bad-env` with GPUPOOL_DRIVER set to a value that means nothing, or as
 * `test_env bad-conf` with GPUPOOL_CONF holding a value PyTorch refuses. Either way every call
 * returns a status with a message that says what to do, and nothing is printed on stderr. */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "gpupool.h"
#include "check.h"

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  int no_driver = strcmp(argv[1], "no-driver") == 0;
  int partial = strcmp(argv[1], "partial-driver") == 0;
  int bad_conf = strcmp(argv[1], "bad-conf") == 0;
  if (no_driver) {
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (lib != NULL) {
      printf("test_env: libcuda.so.1 is present; skipped\n");
      return 77;
    }
  }
  /* Send stderr to a temporary file while gpupool runs, to prove it prints nothing. */
  FILE *capture = tmpfile();
  int saved = dup(2);
  fflush(stderr);
  dup2(fileno(capture), 2);

  void *p = NULL;
  gpupool_status malloc_status = gpupool_malloc(&p, 1024, 0, NULL);
  char message[1024];
  snprintf(message, sizeof message, "%s", gpupool_last_error_message());
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  gpupool_status stats_status = gpupool_stats(0, &s);
  gpupool_status free_status = gpupool_free(NULL);

  fflush(stderr);
  dup2(saved, 2);
  fseek(capture, 0, SEEK_END);
  long printed = ftell(capture);

  gpupool_status want = no_driver || partial ? GPUPOOL_ERROR_DRIVER_UNAVAILABLE : GPUPOOL_ERROR_INVALID_VALUE;
  CHECK(malloc_status == want);
  CHECK(stats_status == want);
  CHECK(free_status == GPUPOOL_SUCCESS);
  CHECK(p == NULL);
  CHECK(strstr(message, no_driver || partial ? "GPUPOOL_DRIVER=sim" : bad_conf ? "GPUPOOL_CONF" : "GPUPOOL_DRIVER") != NULL);
  CHECK(printed == 0);
  if (partial) {
    /* Named, where cudarc would have panicked at the first allocation. */
    CHECK(strstr(message, "lacks cuMemAlloc_v2") != NULL);
  }
  if (bad_conf) {
    /* The first call names the key, the value and what PyTorch requires. */
    CHECK(strstr(message, "gpupool_malloc: environment variable GPUPOOL_CONF: max_split_size_mb:19") != NULL);
    CHECK(strstr(message, "at least large_segment_size_mb (20)") != NULL);
  }
  if (!no_driver && !partial && !bad_conf) {
    /* The options' one reader names the value and what it must be, too. */
    CHECK(strstr(message, "\"opencl\"") != NULL);
    CHECK(strstr(message, "expected cuda or sim") != NULL);
  }
  printf("message: %s\n", message);
  return checks_report(argv[1]);
}
