/* bench's parts (bench.c says what it measures): bench.c the allocators, the main table's
 * workloads, the trace replay and main; bench_frag.c the fragmentation table, each
 * configuration in a child process. */
#ifndef GPUPOOL_BENCH_H
#define GPUPOOL_BENCH_H
#include <cuda_runtime.h>
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "gpupool.h"
#include "cuda_check.h"

#ifdef GPUPOOL_BENCH_TORCH
int torch_init(void);
void *torch_alloc(size_t n, void *stream);
void torch_free(void *p);
long long torch_reserved_peak(void);
long long torch_device_allocs(void);
void torch_reset_peak(void);
void torch_empty_cache(void);
int torch_expandable_segments(void);
#endif

extern char **environ;

typedef struct {
  const char *name;
  void *(*alloc)(size_t n, cudaStream_t s);
  void (*release)(void *p, cudaStream_t s);
  long long (*reserved_peak)(void); /* bytes; NULL when not measured */
  void (*reset)(void);              /* empty the cache and reset peaks */
  long long (*device_allocs)(void); /* segments obtained from the driver so far; NULL: unknown */
  int slow;                         /* cudaMalloc: run fewer iterations */
} allocator_t;

/* Monotonic time in nanoseconds. */
static inline double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* xorshift64: the random working set's generator, in bench_random and random_trace alike. */
static inline uint64_t rng_next(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* The allocators compared (bench.c), `nalloc` of them. */
extern allocator_t allocators[];
extern const int nalloc;
/* This program's path, for the children of the fragmentation table. */
extern char self_path[4096];

/* --- trace replay --- */
typedef struct {
  char op;
  uint32_t id;
  size_t size;
  int stream;
} event_t;
typedef struct {
  const char *name;
  event_t *ev;
  size_t n;
  uint32_t max_id;
  int nstreams;
} trace_t;

trace_t load_trace(const char *path);
/* The random working set as a trace. */
trace_t random_trace(void);

/* What replay_twice measured: ns per event of each pass, the live peak (the most bytes requested
 * and not yet freed at once), and the allocator's reserved peak (bytes) and driver allocations
 * during the cold pass (-1 where the allocator does not report them). */
typedef struct {
  double cold_ns, warm_ns;
  long long peak_live, reserved_peak, device_allocs;
} replay_result_t;
replay_result_t replay_twice(allocator_t *A, trace_t *t);
/* Device 0, cudaMallocAsync's pool at its maximum release threshold, PyTorch when asked. */
void cuda_setup(int with_torch);

/* bench --config SPEC (bench_frag.c): one configuration's fragmentation lines. */
int frag_child(const char *spec, int ntraces, char **paths, char **argv);
/* The fragmentation table: every configuration in a child process (bench_frag.c). */
int bench_frag(int ntraces, char **paths);

#endif
