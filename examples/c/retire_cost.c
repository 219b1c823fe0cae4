/* What gpupool_stream_retire costs a program that destroys streams gpupool never served, with
 * N live blocks on another stream: N blocks of 512 bytes are allocated on one stream, then 200
 * made-up streams are retired, and the mean time of one retire is printed. Run it on the
 * simulated device (its streams are made-up handles, which a GPU would refuse):
 *
 *   GPUPOOL_DRIVER=sim ./retire_cost N
 *
 * The retire asks each shard of the device whether record_stream named the stream for a live
 * block (caching/retire/uses.rs); before it kept that set, it read every live block, each
 * shard locked meanwhile (docs/rules.md has both figures). */
#include <gpupool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { RETIRES = 200 };

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void ok(gpupool_status s) {
  if (s != GPUPOOL_SUCCESS) {
    fprintf(stderr, "retire_cost: %s\n", gpupool_last_error_message());
    exit(1);
  }
}

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 0;
  if (n < 1 || n > 100000000) {
    fprintf(stderr, "usage: retire_cost N (live blocks, 1 to 100,000,000)\n");
    return 2;
  }
  void **live = malloc(sizeof *live * (size_t)n);
  if (!live) {
    fprintf(stderr, "retire_cost: no host memory for %ld pointers\n", n);
    return 2;
  }
  gpupool_stream_t owner = (gpupool_stream_t)(uintptr_t)0x1000;
  for (long i = 0; i < n; i++) ok(gpupool_malloc(&live[i], 512, 0, owner));
  int waited = 0, waits = 0;
  double t0 = now_s();
  for (int r = 0; r < RETIRES; r++) {
    ok(gpupool_stream_retire(0, (gpupool_stream_t)(uintptr_t)(0x50000 + 16 * r), &waited));
    waits += waited;
  }
  double us = (now_s() - t0) / RETIRES * 1e6;
  printf("retire_cost: %ld live block(s): %.2f us a retire of a stream gpupool never served (%d waited)\n", n, us,
         waits);
  for (long i = 0; i < n; i++) ok(gpupool_free(live[i]));
  free(live);
  return waits != 0;
}
