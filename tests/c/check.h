/* A minimal assertion harness for gpupool's C tests: each CHECK that fails prints where, what,
 * and gpupool's last error message, and the test exits non-zero at the end. */
#ifndef GPUPOOL_TEST_CHECK_H
#define GPUPOOL_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int checks_failed;
static int checks_passed;

#define CHECK(cond)                                                                        \
  do {                                                                                     \
    if (cond) {                                                                            \
      checks_passed++;                                                                     \
    } else {                                                                               \
      checks_failed++;                                                                     \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last gpupool error: %s\n", __FILE__,       \
              __LINE__, #cond, gpupool_last_error_message());                              \
    }                                                                                      \
  } while (0)

#define CHECK_OK(call) CHECK((call) == GPUPOOL_SUCCESS)

static inline int checks_report(const char *name) {
  printf("%s: %d passed, %d failed\n", name, checks_passed, checks_failed);
  return checks_failed == 0 ? 0 : 1;
}

#endif
