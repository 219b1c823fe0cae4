/* The hit path through the C ABI, for instruction counts under callgrind: PAIRS pairs of
 * gpupool_malloc + gpupool_free of SIZE bytes on one stream of the simulated device (device),
 * or of gpupool_host_malloc + gpupool_host_free (host), each pair served from the cache after
 * a first pair outside the loop. hit_budget.sh runs it twice and divides the difference.
 *
 *   hit_loop device|host PAIRS SIZE */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"

static void ok(gpupool_status s, const char *what) {
  if (s != GPUPOOL_SUCCESS) {
    fprintf(stderr, "hit_loop: %s: %s\n", what, gpupool_last_error_message());
    exit(1);
  }
}

int main(int argc, char **argv) {
  if (argc != 4 || (strcmp(argv[1], "device") != 0 && strcmp(argv[1], "host") != 0)) {
    fprintf(stderr, "usage: hit_loop device|host PAIRS SIZE\n");
    return 2;
  }
  int host = strcmp(argv[1], "host") == 0;
  long pairs = atol(argv[2]);
  size_t size = (size_t)atol(argv[3]);
  gpupool_stream_t stream = (gpupool_stream_t)0x10;
  void *p = NULL;
  /* The first pair makes the segment (or the pinned block) and starts the allocator. */
  for (long i = 0; i <= pairs; i++) {
    if (host) {
      ok(gpupool_host_malloc(&p, size), "gpupool_host_malloc");
      ok(gpupool_host_free(p), "gpupool_host_free");
    } else {
      ok(gpupool_malloc(&p, size, 0, stream), "gpupool_malloc");
      ok(gpupool_free(p), "gpupool_free");
    }
  }
  return 0;
}
