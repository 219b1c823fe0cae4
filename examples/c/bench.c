/* bench: gpupool beside cudaMalloc, cudaMallocAsync (default pool, release threshold at its
 * maximum) and, when built with Torch, PyTorch's c10 caching allocator, on the same workloads.
 *
 * The main table, in one process: the hit path, a random working set, threads on their own
 * streams, and the replay of recorded allocation traces, each figure with its ratio to
 * gpupool's.
 *
 * The fragmentation table: the random working set and every trace under each configuration
 * (gpupool and PyTorch, each by default and with expandable_segments:True, and
 * cudaMallocAsync), peak reserved against peak live, ns per event cold and warm, and driver
 * allocations. Both allocators fix their configuration at first use, for the whole process
 * (GPUPOOL_CONF, PYTORCH_CUDA_ALLOC_CONF), so each configuration runs in a child process: bench
 * runs itself with --config and gathers the children's lines.
 *
 * Usage: bench [trace.txt ...]  (traces in shared/traces format, uncompressed)
 *   BENCH_ONLY=main      the main table only
 *   BENCH_ONLY=frag      the fragmentation table only
 *   bench --config ALLOCATOR[:CONF] [trace.txt ...]
 *                        one configuration's fragmentation figures as tab-separated lines
 *                        (ALLOCATOR: gpupool, pytorch or cudaMallocAsync; CONF in PyTorch's
 *                        syntax, e.g. gpupool:expandable_segments:True); it sets GPUPOOL_CONF
 *                        or PYTORCH_CUDA_ALLOC_CONF to CONF (unset without one) and runs
 *                        itself again when the environment differs. */
#define _POSIX_C_SOURCE 200809L
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

#define CUDA(call)                                                                           \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

typedef struct {
  const char *name;
  void *(*alloc)(size_t n, cudaStream_t s);
  void (*release)(void *p, cudaStream_t s);
  long long (*reserved_peak)(void); /* bytes; NULL when not measured */
  void (*reset)(void);              /* empty the cache and reset peaks */
  long long (*device_allocs)(void); /* segments obtained from the driver so far; NULL: unknown */
  int slow;                         /* cudaMalloc: run fewer iterations */
} allocator_t;

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* The device gpupool allocates on: 0, or the thread's device in the threads workload split over
 * two GPUs (an explicit ordinal: -1 would ask the driver for the current device on every call). */
static _Thread_local int gp_device = 0;

static void *gp_alloc(size_t n, cudaStream_t s) {
  void *p = NULL;
  if (gpupool_malloc(&p, n, gp_device, (gpupool_stream_t)s) != GPUPOOL_SUCCESS) {
    fprintf(stderr, "%s (%zu bytes)\n", gpupool_last_error_message(), n);
    exit(1);
  }
  return p;
}
static void gp_free(void *p, cudaStream_t s) {
  (void)s;
  gpupool_free(p);
}
static long long gp_peak(void) {
  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  gpupool_stats(0, &st);
  return st.reserved_bytes.all.peak;
}
static long long gp_device_allocs(void) {
  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  gpupool_stats(0, &st);
  return st.num_device_alloc;
}
static void gp_reset(void) {
  gpupool_empty_cache(0);
  gpupool_reset_peak_stats(0);
}

static void *cm_alloc(size_t n, cudaStream_t s) {
  (void)s;
  void *p = NULL;
  CUDA(cudaMalloc(&p, n));
  return p;
}
static void cm_free(void *p, cudaStream_t s) {
  (void)s;
  CUDA(cudaFree(p));
}

static cudaMemPool_t async_pool;
static void *ca_alloc(size_t n, cudaStream_t s) {
  void *p = NULL;
  CUDA(cudaMallocAsync(&p, n, s));
  return p;
}
static void ca_free(void *p, cudaStream_t s) { CUDA(cudaFreeAsync(p, s)); }
static long long ca_peak(void) {
  uint64_t v = 0;
  CUDA(cudaMemPoolGetAttribute(async_pool, cudaMemPoolAttrReservedMemHigh, &v));
  return (long long)v;
}
static void ca_reset(void) {
  uint64_t zero = 0;
  CUDA(cudaDeviceSynchronize());
  CUDA(cudaMemPoolTrimTo(async_pool, 0));
  CUDA(cudaMemPoolSetAttribute(async_pool, cudaMemPoolAttrReservedMemHigh, &zero));
}

#ifdef GPUPOOL_BENCH_TORCH
static void *pt_alloc(size_t n, cudaStream_t s) { return torch_alloc(n, (void *)s); }
static void pt_free(void *p, cudaStream_t s) {
  (void)s;
  torch_free(p);
}
static void pt_reset(void) {
  torch_empty_cache();
  torch_reset_peak();
}
#endif

static allocator_t allocators[] = {
    {"gpupool", gp_alloc, gp_free, gp_peak, gp_reset, gp_device_allocs, 0},
#ifdef GPUPOOL_BENCH_TORCH
    {"pytorch", pt_alloc, pt_free, torch_reserved_peak, pt_reset, torch_device_allocs, 0},
#endif
    {"cudaMallocAsync", ca_alloc, ca_free, ca_peak, ca_reset, NULL, 0},
    {"cudaMalloc", cm_alloc, cm_free, NULL, NULL, NULL, 1},
};
#define NALLOC ((int)(sizeof allocators / sizeof allocators[0]))

/* Results: rows of (workload, metric) with one value per allocator. */
#define MAXROWS 64
static char row_name[MAXROWS][64];
static char row_unit[MAXROWS][24];
static double row_val[MAXROWS][8];
static int row_lower_better[MAXROWS];
static int nrows;

static int row(const char *name, const char *unit, int lower_better) {
  for (int r = 0; r < nrows; r++)
    if (strcmp(row_name[r], name) == 0 && strcmp(row_unit[r], unit) == 0) return r;
  if (nrows == MAXROWS) {
    fprintf(stderr, "bench: more than %d rows (too many traces)\n", MAXROWS);
    exit(1);
  }
  snprintf(row_name[nrows], 64, "%s", name);
  snprintf(row_unit[nrows], 24, "%s", unit);
  row_lower_better[nrows] = lower_better;
  for (int a = 0; a < 8; a++) row_val[nrows][a] = -1;
  return nrows++;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* --- hit path: one size allocated and freed on one stream, ns per pair, median of 5 runs --- */
static void bench_hit(int ai, cudaStream_t s) {
  allocator_t *A = &allocators[ai];
  size_t sizes[] = {512, 1 << 20, 16 << 20};
  const char *names[] = {"hit pair 512 B", "hit pair 1 MiB", "hit pair 16 MiB"};
  for (int k = 0; k < 3; k++) {
    int n = A->slow ? 200 : 20000;
    double runs[5];
    A->release(A->alloc(sizes[k], s), s);
    for (int r = 0; r < 5; r++) {
      double t0 = now_ns();
      for (int i = 0; i < n; i++) A->release(A->alloc(sizes[k], s), s);
      runs[r] = (now_ns() - t0) / n;
    }
    qsort(runs, 5, sizeof(double), cmp_double);
    row_val[row(names[k], "ns/pair", 1)][ai] = runs[2];
  }
}

static uint64_t rng_next(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* --- random working set (after RMM's random_allocations): sizes log-uniform 256 B to 4 GiB,
 * up to 1000 live (live bytes peak near 59 GB) --- */
static void bench_random(int ai, cudaStream_t s) {
  allocator_t *A = &allocators[ai];
  enum { LIVE = 1000 };
  static void *ptr[LIVE];
  static size_t size[LIVE];
  int ops = A->slow ? 2000 : 100000, live = 0;
  uint64_t rng = 0x2545F4914F6CDD1DULL;
  long long cur = 0, peak_live = 0;
  if (A->reset) A->reset();
  double t0 = now_ns();
  for (int i = 0; i < ops; i++) {
    int do_alloc = live == 0 || (live < LIVE && (rng_next(&rng) & 1));
    if (do_alloc) {
      double u = (double)(rng_next(&rng) >> 11) / 9007199254740992.0;
      size_t n = (size_t)(256.0 * exp(u * log(65536.0 * 4.0 * 64.0)));
      ptr[live] = A->alloc(n, s);
      size[live] = n;
      cur += (long long)n;
      if (cur > peak_live) peak_live = cur;
      live++;
    } else {
      int k = (int)(rng_next(&rng) % (uint64_t)live);
      A->release(ptr[k], s);
      cur -= (long long)size[k];
      ptr[k] = ptr[live - 1];
      size[k] = size[live - 1];
      live--;
    }
  }
  double per_op = (now_ns() - t0) / ops;
  for (int k = 0; k < live; k++) A->release(ptr[k], s);
  row_val[row("random working set", "ns/op", 1)][ai] = per_op;
  if (A->reserved_peak) row_val[row("random working set", "reserved/live", 1)][ai] = (double)A->reserved_peak() / (double)peak_live;
}

/* --- threads, each on its own non-blocking stream: sizes 4 KiB..1 MiB, 16 live a thread --- */
typedef struct {
  allocator_t *A;
  cudaStream_t s;
  int device;
  int ops;
  pthread_barrier_t *start;
} thread_arg;

static void *thread_body(void *v) {
  thread_arg *t = v;
  CUDA(cudaSetDevice(t->device));
  gp_device = t->device;
  void *live[16];
  uint64_t rng = (uint64_t)(uintptr_t)t->s | 1;
  for (int k = 0; k < 16; k++) live[k] = t->A->alloc((size_t)4096 << (k % 9), t->s);
  /* Warm-up, untimed: the same loop once, so that each stream's pool has grown to what the
   * loop holds (the growth's driver calls serialise in the driver) and the timed window below
   * measures the steady state every thread count reaches. */
  for (int i = 0; i < t->ops / 2; i++) {
    int k = i % 16;
    t->A->release(live[k], t->s);
    live[k] = t->A->alloc((size_t)4096 << (rng_next(&rng) % 9), t->s);
  }
  pthread_barrier_wait(t->start);
  for (int i = 0; i < t->ops / 2; i++) {
    int k = i % 16;
    t->A->release(live[k], t->s);
    live[k] = t->A->alloc((size_t)4096 << (rng_next(&rng) % 9), t->s);
  }
  pthread_barrier_wait(t->start);
  for (int k = 0; k < 16; k++) t->A->release(live[k], t->s);
  return NULL;
}

/* 1, 4 and 16 threads on device 0; with two GPUs or more, 16 threads again, half on each of
 * devices 0 and 1 (each device's memory and locks its own). */
static void bench_threads(int ai) {
  allocator_t *A = &allocators[ai];
  int counts[] = {1, 4, 16, 16};
  const char *names[] = {"1 thread", "4 threads", "16 threads", "16 threads, 2 GPUs"};
  int devices = 0;
  CUDA(cudaGetDeviceCount(&devices));
  int configs = devices >= 2 ? 4 : 3;
  for (int c = 0; c < configs; c++) {
    /* gpupool's pairs are ~10x the others': 5x the operations, so that its timed window (about
     * 0.1 s) is as long as theirs and not a few thread start-ups. */
    int n = counts[c], ops = A->slow ? 400 : ai == 0 ? 1000000 : 200000;
    int split = c == 3;
    pthread_t th[16];
    thread_arg args[16];
    cudaStream_t streams[16];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    for (int t = 0; t < n; t++) {
      int device = split ? t % 2 : 0;
      CUDA(cudaSetDevice(device));
      CUDA(cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking));
      args[t] = (thread_arg){A, streams[t], device, ops, &start};
      pthread_create(&th[t], NULL, thread_body, &args[t]);
    }
    CUDA(cudaSetDevice(0));
    pthread_barrier_wait(&start);
    double t0 = now_ns();
    pthread_barrier_wait(&start);
    double secs = (now_ns() - t0) / 1e9;
    for (int t = 0; t < n; t++) pthread_join(th[t], NULL);
    for (int d = split ? 1 : 0; d >= 0; d--) {
      CUDA(cudaSetDevice(d));
      CUDA(cudaDeviceSynchronize());
    }
    for (int t = 0; t < n; t++) CUDA(cudaStreamDestroy(streams[t]));
    pthread_barrier_destroy(&start);
    row_val[row(names[c], "Mops/s", 0)][ai] = (double)n * ops / secs / 1e6;
  }
}

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

static trace_t load_trace(const char *path) {
  trace_t t = {0};
  const char *slash = strrchr(path, '/');
  t.name = slash ? slash + 1 : path;
  FILE *f = fopen(path, "r");
  if (!f) {
    perror(path);
    exit(1);
  }
  size_t cap = 1 << 16;
  t.ev = malloc(cap * sizeof(event_t));
  unsigned long long streams[64];
  char line[256];
  while (fgets(line, sizeof line, f)) {
    event_t e = {0};
    unsigned long long id = 0, size = 0, stream = 0;
    if (line[0] == 'a' && sscanf(line, "a %llu %llu %llu", &id, &size, &stream) == 3) {
      int k = 0;
      while (k < t.nstreams && streams[k] != stream) k++;
      if (k == 64) {
        fprintf(stderr, "%s: more than 64 streams\n", path);
        exit(1);
      }
      if (k == t.nstreams) streams[t.nstreams++] = stream;
      e = (event_t){'a', (uint32_t)id, (size_t)size, k};
    } else if (line[0] == 'f' && sscanf(line, "f %llu", &id) == 1) {
      e = (event_t){'f', (uint32_t)id, 0, 0};
    } else {
      continue;
    }
    if (e.id > t.max_id) t.max_id = e.id;
    if (t.n == cap) t.ev = realloc(t.ev, (cap *= 2) * sizeof(event_t));
    t.ev[t.n++] = e;
  }
  fclose(f);
  return t;
}

/* One pass over the trace; returns ns per event and raises *peak_live to the live peak. */
static double replay_pass(allocator_t *A, trace_t *t, cudaStream_t *streams, void **ptr, size_t *size, int *owner,
                          long long *peak_live) {
  long long cur = 0;
  double t0 = now_ns();
  for (size_t i = 0; i < t->n; i++) {
    event_t *e = &t->ev[i];
    if (e->op == 'a') {
      ptr[e->id] = A->alloc(e->size, streams[e->stream]);
      size[e->id] = e->size;
      owner[e->id] = e->stream;
      cur += (long long)e->size;
      if (cur > *peak_live) *peak_live = cur;
    } else if (ptr[e->id]) {
      A->release(ptr[e->id], streams[owner[e->id]]);
      ptr[e->id] = NULL;
      cur -= (long long)size[e->id];
    }
  }
  double per_event = (now_ns() - t0) / (double)t->n;
  for (uint32_t i = 0; i <= t->max_id; i++) {
    if (ptr[i]) A->release(ptr[i], streams[owner[i]]);
    ptr[i] = NULL;
  }
  return per_event;
}

/* What replay_twice measured: ns per event of each pass, the live peak (the most bytes requested
 * and not yet freed at once), and the allocator's reserved peak (bytes) and driver allocations
 * during the cold pass (-1 where the allocator does not report them). */
typedef struct {
  double cold_ns, warm_ns;
  long long peak_live, reserved_peak, device_allocs;
} replay_result_t;

/* The trace from an empty cache ("cold": the model's first step, when segments come from the
 * driver), then again with what the first pass left cached ("warm": every later step, the
 * allocator's own cost). Reserved and device allocations are the cold pass's, comparable with
 * the figures PyTorch recorded with the traces. */
static replay_result_t replay_twice(allocator_t *A, trace_t *t) {
  replay_result_t r = {0, 0, 0, -1, -1};
  void **ptr = calloc(t->max_id + 1, sizeof(void *));
  size_t *size = calloc(t->max_id + 1, sizeof(size_t));
  int *owner = calloc(t->max_id + 1, sizeof(int));
  cudaStream_t streams[64];
  for (int k = 0; k < t->nstreams; k++) CUDA(cudaStreamCreateWithFlags(&streams[k], cudaStreamNonBlocking));
  if (A->reset) A->reset();
  long long allocs0 = A->device_allocs ? A->device_allocs() : 0;
  r.cold_ns = replay_pass(A, t, streams, ptr, size, owner, &r.peak_live);
  if (A->device_allocs) r.device_allocs = A->device_allocs() - allocs0;
  if (A->reserved_peak) r.reserved_peak = A->reserved_peak();
  r.warm_ns = replay_pass(A, t, streams, ptr, size, owner, &r.peak_live);
  CUDA(cudaDeviceSynchronize());
  /* The cache goes back while the trace's streams still exist: PyTorch 2.11 with expandable
   * segments synchronises each segment's stream in emptyCache and dies on a destroyed one. */
  if (A->reset) A->reset();
  for (int k = 0; k < t->nstreams; k++) CUDA(cudaStreamDestroy(streams[k]));
  free(ptr);
  free(size);
  free(owner);
  return r;
}

static void bench_replay(int ai, trace_t *t) {
  allocator_t *A = &allocators[ai];
  if (A->slow) return; /* minutes per trace; GPU.md and the traces' README give its figures */
  replay_result_t r = replay_twice(A, t);
  char name[64];
  snprintf(name, sizeof name, "replay %s", t->name);
  row_val[row(name, "ns/event", 1)][ai] = r.cold_ns;
  if (r.device_allocs >= 0) row_val[row(name, "device allocs", 1)][ai] = (double)r.device_allocs;
  snprintf(name, sizeof name, "replay %s warm", t->name);
  row_val[row(name, "ns/event", 1)][ai] = r.warm_ns;
  snprintf(name, sizeof name, "replay %s", t->name);
  if (r.reserved_peak >= 0) row_val[row(name, "reserved/live", 1)][ai] = (double)r.reserved_peak / (double)r.peak_live;
}

/* The random working set of bench_random as a trace (the same generator and seed, so the same
 * sizes in the same order), for the fragmentation table. */
static trace_t random_trace(void) {
  enum { LIVE = 1000, OPS = 100000 };
  trace_t t = {0};
  t.name = "random working set";
  t.nstreams = 1;
  t.ev = malloc(OPS * sizeof(event_t));
  static uint32_t live_id[LIVE];
  int live = 0;
  uint32_t next = 0;
  uint64_t rng = 0x2545F4914F6CDD1DULL;
  for (int i = 0; i < OPS; i++) {
    int do_alloc = live == 0 || (live < LIVE && (rng_next(&rng) & 1));
    if (do_alloc) {
      double u = (double)(rng_next(&rng) >> 11) / 9007199254740992.0;
      size_t n = (size_t)(256.0 * exp(u * log(65536.0 * 4.0 * 64.0)));
      t.ev[t.n++] = (event_t){'a', next, n, 0};
      live_id[live++] = next++;
    } else {
      int k = (int)(rng_next(&rng) % (uint64_t)live);
      t.ev[t.n++] = (event_t){'f', live_id[k], 0, 0};
      live_id[k] = live_id[live - 1];
      live--;
    }
  }
  t.max_id = next - 1;
  return t;
}

static void cuda_setup(int with_torch) {
  CUDA(cudaSetDevice(0));
  CUDA(cudaFree(NULL));
  CUDA(cudaDeviceGetDefaultMemPool(&async_pool, 0));
  uint64_t max = UINT64_MAX;
  CUDA(cudaMemPoolSetAttribute(async_pool, cudaMemPoolAttrReleaseThreshold, &max));
#ifdef GPUPOOL_BENCH_TORCH
  if (with_torch) torch_init();
#else
  (void)with_torch;
#endif
}

/* --- fragmentation: each configuration in a child process --- */
static const char *frag_specs[] = {
    "gpupool",
    "gpupool:expandable_segments:False",
    "gpupool;GPUPOOL_EXPANDABLE_LARGE_PAGES=0",
    "gpupool;GPUPOOL_EXPANDABLE_LARGE_PAGES=0;GPUPOOL_EXPANDABLE_RECLAIM=1",
    "gpupool;GPUPOOL_EXPANDABLE_RECLAIM=1",
#ifdef GPUPOOL_BENCH_TORCH
    "pytorch",
    "pytorch:expandable_segments:True",
#endif
    "cudaMallocAsync",
};
#define NFRAG ((int)(sizeof frag_specs / sizeof frag_specs[0]))

static char self_path[4096];

/* The environment variable holding ALLOCATOR's configuration; NULL for one without any. */
static const char *conf_var(const char *allocator) {
  if (strcmp(allocator, "gpupool") == 0) return "GPUPOOL_CONF";
  if (strcmp(allocator, "pytorch") == 0) return "PYTORCH_CUDA_ALLOC_CONF";
  return NULL;
}

/* Splits SPEC (ALLOCATOR[:CONF][;VAR=VALUE...]): the allocator's name into name, CONF into conf
 * (empty when there is none), and returns the settings after the first ';' (gpupool's own
 * environment variables, which GPUPOOL_CONF does not hold), "" when there are none. */
static const char *split_spec(const char *spec, char *name, size_t len, char *conf, size_t conf_len) {
  size_t end = strcspn(spec, ";");
  size_t n = strcspn(spec, ":");
  if (n > end) n = end;
  snprintf(name, len, "%.*s", (int)n, spec);
  size_t from = n < end ? n + 1 : end;
  snprintf(conf, conf_len, "%.*s", (int)(end - from), spec + from);
  return spec[end] == ';' ? spec + end + 1 : "";
}

/* The next VAR=VALUE of a settings list (split_spec's result) into var and value; returns
 * the rest of the list, NULL when the list is done. */
static const char *next_setting(const char *list, char *var, size_t var_len, char *value, size_t value_len) {
  if (*list == '\0') return NULL;
  size_t n = strcspn(list, ";");
  const char *eq = memchr(list, '=', n);
  size_t v = eq ? (size_t)(eq - list) : n;
  snprintf(var, var_len, "%.*s", (int)v, list);
  snprintf(value, value_len, "%.*s", eq ? (int)(n - v - 1) : 0, eq ? eq + 1 : "");
  return list[n] == ';' ? list + n + 1 : list + n;
}

/* Whether environment entry env ("VAR=VALUE") sets a variable that some configuration's
 * settings set: the parent's value must not leak into the configurations that leave it
 * at its default. */
static int set_by_specs(const char *env) {
  char var[128], value[128];
  for (size_t i = 0; i < sizeof frag_specs / sizeof frag_specs[0]; i++) {
    char name[32], conf[512];
    for (const char *l = split_spec(frag_specs[i], name, sizeof name, conf, sizeof conf);
         (l = next_setting(l, var, sizeof var, value, sizeof value)) != NULL;) {
      size_t n = strlen(var);
      if (strncmp(env, var, n) == 0 && env[n] == '=') return 1;
    }
  }
  return 0;
}

/* Gives VAR the value VALUE (unset for NULL) from the start of the process: when the
 * environment differs, sets it and runs this program again, since an allocator may read its
 * variable before main. Called before any CUDA call, while the process has one thread. */
static void ensure_env(const char *var, const char *value, char **argv) {
  const char *cur = getenv(var);
  int set = cur != NULL && cur[0] != '\0';
  if (value == NULL ? !set : (set && strcmp(cur, value) == 0)) return;
  if (value != NULL ? setenv(var, value, 1) : unsetenv(var)) {
    perror(var);
    exit(1);
  }
  execv(self_path, argv);
  perror(self_path);
  exit(1);
}

/* in, lower case and without spaces, into out. */
static void squeeze(const char *in, char *out, size_t len) {
  size_t j = 0;
  for (; *in && j + 1 < len; in++)
    if (!isspace((unsigned char)*in)) out[j++] = (char)tolower((unsigned char)*in);
  out[j] = '\0';
}

/* Whether text (a configuration as an allocator shows it) holds every key:value pair of conf
 * (PyTorch's syntax: pairs separated by commas), ignoring case and spaces. */
static int config_shows(const char *text, const char *conf) {
  char t[4096], pair[256], p[256];
  squeeze(text, t, sizeof t);
  while (*conf) {
    size_t n = strcspn(conf, ",");
    snprintf(pair, sizeof pair, "%.*s", (int)n, conf);
    squeeze(pair, p, sizeof p);
    if (p[0] != '\0' && strstr(t, p) == NULL) return 0;
    conf += n;
    if (*conf == ',') conf++;
  }
  return 1;
}

static void frag_line(const char *spec, allocator_t *A, trace_t *t) {
  fprintf(stderr, "bench --config %s: %s\n", spec, t->name);
  replay_result_t r = replay_twice(A, t);
  printf("frag\t%s\t%lld\t%lld\t%.1f\t%.1f\t%lld\n", t->name, r.peak_live, r.reserved_peak, r.cold_ns, r.warm_ns,
         r.device_allocs);
  fflush(stdout);
}

/* bench --config SPEC: one configuration's fragmentation figures, one tab-separated line per
 * workload ("frag", name, peak live bytes, peak reserved bytes, ns/event cold, warm, device
 * allocs), after a "config" line with what the allocator made of its configuration. Exits 1
 * when the configuration did not take effect. */
static int frag_child(const char *spec, int ntraces, char **paths, char **argv) {
  char name[32], conf_text[512], set_var[128], set_value[128];
  const char *settings = split_spec(spec, name, sizeof name, conf_text, sizeof conf_text);
  const char *conf = conf_text[0] ? conf_text : NULL;
  const char *var = conf_var(name);
  int ai = -1;
  for (int a = 0; a < NALLOC; a++)
    if (strcmp(allocators[a].name, name) == 0 && !allocators[a].slow) ai = a;
  if (ai < 0 || (conf != NULL && var == NULL) || (settings[0] && strcmp(name, "gpupool") != 0)) {
    fprintf(stderr, "bench --config %s: expected gpupool[:CONF][;VAR=VALUE...], pytorch[:CONF] (when built with "
                    "PyTorch) or cudaMallocAsync\n", spec);
    return 2;
  }
  if (var != NULL) ensure_env(var, conf, argv);
  for (const char *l = settings; (l = next_setting(l, set_var, sizeof set_var, set_value, sizeof set_value)) != NULL;)
    ensure_env(set_var, set_value[0] ? set_value : NULL, argv);
  allocator_t *A = &allocators[ai];
  cuda_setup(strcmp(name, "pytorch") == 0);

  /* What the allocator made of its configuration, seen after a first allocation (each reads
   * its configuration at first use). */
  char text[4096] = "the device's default pool, release threshold at its maximum";
  int ok = 1;
  void *probe = A->alloc(1 << 20, NULL);
  if (strcmp(name, "gpupool") == 0) {
    size_t needed = 0;
    if (gpupool_config_string(text, sizeof text, &needed) != GPUPOOL_SUCCESS) {
      snprintf(text, sizeof text, "gpupool_config_string failed: %s", gpupool_last_error_message());
      ok = 0;
    } else if (conf != NULL && !config_shows(text, conf)) {
      ok = 0;
    }
  }
#ifdef GPUPOOL_BENCH_TORCH
  if (strcmp(name, "pytorch") == 0) {
    int seen = torch_expandable_segments();
    int wanted = conf != NULL && config_shows(conf, "expandable_segments:True");
    snprintf(text, sizeof text, "PYTORCH_CUDA_ALLOC_CONF=%s; its segments: %s", conf ? conf : "(unset)",
             seen > 0 ? "expandable" : seen == 0 ? "not expandable" : "none");
    ok = seen == wanted;
  }
#endif
  A->release(probe, NULL);
  if (A->reset) A->reset();
  printf("config\t%s\t%s\n", spec, text);
  fflush(stdout);
  if (!ok) {
    fprintf(stderr, "bench --config %s: the configuration did not take effect (%s)\n", spec, text);
    return 1;
  }

  trace_t rnd = random_trace();
  frag_line(spec, A, &rnd);
  free(rnd.ev);
  for (int i = 0; i < ntraces; i++) {
    trace_t t = load_trace(paths[i]);
    frag_line(spec, A, &t);
    free(t.ev);
  }
  return 0;
}

typedef struct {
  int have;
  long long live, reserved, allocs;
  double cold, warm;
} frag_cell_t;
#define MAXWORK 64
static char frag_work[MAXWORK][128];
static int nfrag_work;
static frag_cell_t frag_cell[MAXWORK][NFRAG];
static char frag_note[NFRAG][2048];

static int frag_workload(const char *name) {
  for (int w = 0; w < nfrag_work; w++)
    if (strcmp(frag_work[w], name) == 0) return w;
  if (nfrag_work == MAXWORK) {
    fprintf(stderr, "bench: more than %d workloads\n", MAXWORK);
    exit(1);
  }
  snprintf(frag_work[nfrag_work], sizeof frag_work[0], "%s", name);
  return nfrag_work++;
}

/* Runs configuration ci in a child (bench --config), with GPUPOOL_CONF and
 * PYTORCH_CUDA_ALLOC_CONF removed from its environment but for the one its configuration sets,
 * and gathers its lines. Returns 0 when the child succeeded. */
static int frag_run(int ci, int ntraces, char **paths) {
  const char *spec = frag_specs[ci];
  char name[32], assign[512], conf_text[512];
  split_spec(spec, name, sizeof name, conf_text, sizeof conf_text);
  const char *conf = conf_text[0] ? conf_text : NULL;
  const char *var = conf_var(name);
  size_t n = 0;
  while (environ[n]) n++;
  char **envp = calloc(n + 2, sizeof(char *));
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "GPUPOOL_CONF=", 13) != 0 && strncmp(environ[i], "PYTORCH_CUDA_ALLOC_CONF=", 24) != 0 &&
        !set_by_specs(environ[i]))
      envp[k++] = environ[i];
  if (conf != NULL && var != NULL) {
    snprintf(assign, sizeof assign, "%s=%s", var, conf);
    envp[k++] = assign;
  }
  envp[k] = NULL;
  char **args = calloc((size_t)ntraces + 4, sizeof(char *));
  args[0] = self_path;
  args[1] = "--config";
  args[2] = (char *)spec;
  for (int i = 0; i < ntraces; i++) args[3 + i] = paths[i];

  int fd[2];
  if (pipe(fd) != 0) {
    perror("pipe");
    exit(1);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd[1], 1);
  posix_spawn_file_actions_addclose(&fa, fd[0]);
  posix_spawn_file_actions_addclose(&fa, fd[1]);
  fflush(stdout);
  pid_t pid;
  int err = posix_spawn(&pid, self_path, &fa, NULL, args, envp);
  posix_spawn_file_actions_destroy(&fa);
  close(fd[1]);
  free(envp);
  free(args);
  if (err != 0) {
    fprintf(stderr, "bench: posix_spawn %s: %s\n", self_path, strerror(err));
    exit(1);
  }
  FILE *in = fdopen(fd[0], "r");
  static char line[8192];
  while (fgets(line, sizeof line, in)) {
    line[strcspn(line, "\n")] = '\0';
    if (strncmp(line, "config\t", 7) == 0) {
      const char *text = strchr(line + 7, '\t');
      snprintf(frag_note[ci], sizeof frag_note[ci], "%s", text ? text + 1 : "");
    } else if (strncmp(line, "frag\t", 5) == 0) {
      char *f[7], *save = NULL;
      int nf = 0;
      for (char *p = strtok_r(line, "\t", &save); p && nf < 7; p = strtok_r(NULL, "\t", &save)) f[nf++] = p;
      if (nf != 7) {
        fprintf(stderr, "bench: --config %s wrote a line of %d fields\n", spec, nf);
        continue;
      }
      frag_cell_t *c = &frag_cell[frag_workload(f[1])][ci];
      *c = (frag_cell_t){1, atoll(f[2]), atoll(f[3]), atoll(f[6]), atof(f[4]), atof(f[5])};
    } else {
      fprintf(stderr, "%s\n", line);
    }
  }
  fclose(in);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) {
      perror("waitpid");
      exit(1);
    }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
  char why[64];
  if (WIFSIGNALED(status))
    snprintf(why, sizeof why, "died of signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
  else
    snprintf(why, sizeof why, "exited with %d", WEXITSTATUS(status));
  size_t used = strlen(frag_note[ci]);
  snprintf(frag_note[ci] + used, sizeof frag_note[ci] - used, "%sFAILED: %s", used ? "; " : "", why);
  return 1;
}

/* The fragmentation table; returns 1 when a configuration failed. */
static int bench_frag(int ntraces, char **paths) {
  int failed = 0;
  for (int ci = 0; ci < NFRAG; ci++) {
    fprintf(stderr, "bench: fragmentation, %s\n", frag_specs[ci]);
    failed |= frag_run(ci, ntraces, paths);
  }
  printf("\nFragmentation, each configuration in its own process (live: the peak of the sum of live requested "
         "sizes; reserved and device allocs: the cold pass's):\n\n");
  printf("| workload | configuration | reserved/live | peak reserved MiB | peak live MiB | ns/event cold | "
         "ns/event warm | device allocs |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (int w = 0; w < nfrag_work; w++) {
    for (int ci = 0; ci < NFRAG; ci++) {
      frag_cell_t *c = &frag_cell[w][ci];
      char label[256], ratio[32] = "-", reserved[32] = "-", allocs[32] = "-";
      snprintf(label, sizeof label, "%s", frag_specs[ci]);
      char *colon = strchr(label, ':');
      if (colon) *colon = ' ';
      if (!c->have) {
        printf("| %s | %s | - | - | - | - | - | - |\n", frag_work[w], label);
        continue;
      }
      if (c->reserved >= 0 && c->live > 0) {
        snprintf(ratio, sizeof ratio, "%.2f", (double)c->reserved / (double)c->live);
        snprintf(reserved, sizeof reserved, "%.0f", (double)c->reserved / 1048576.0);
      }
      if (c->allocs >= 0) snprintf(allocs, sizeof allocs, "%lld", c->allocs);
      printf("| %s | %s | %s | %s | %.1f | %.0f | %.0f | %s |\n", frag_work[w], label, ratio, reserved,
             (double)c->live / 1048576.0, c->cold, c->warm, allocs);
    }
  }
  printf("\n");
  for (int ci = 0; ci < NFRAG; ci++) printf("- %s: %s\n", frag_specs[ci], frag_note[ci]);
  return failed;
}

int main(int argc, char **argv) {
  ssize_t len = readlink("/proc/self/exe", self_path, sizeof self_path - 1);
  if (len <= 0) {
    perror("readlink /proc/self/exe");
    return 1;
  }
  self_path[len] = '\0';
  if (argc >= 2 && strcmp(argv[1], "--config") == 0) {
    if (argc < 3) {
      fprintf(stderr, "usage: bench --config ALLOCATOR[:CONF] [trace.txt ...]\n");
      return 2;
    }
    return frag_child(argv[2], argc - 3, argv + 3, argv);
  }
  const char *only = getenv("BENCH_ONLY");
  int run_main = 1, run_frag = 1;
  if (only != NULL && only[0] != '\0') {
    run_main = strcmp(only, "main") == 0;
    run_frag = strcmp(only, "frag") == 0;
    if (!run_main && !run_frag) {
      fprintf(stderr, "BENCH_ONLY=%s: expected main or frag\n", only);
      return 2;
    }
  }
  cuda_setup(run_main);
  struct cudaDeviceProp prop;
  CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0;
  CUDA(cudaDriverGetVersion(&driver));
  printf("bench: %s, CUDA driver %d.%d, gpupool %s\n", prop.name, driver / 1000, (driver % 1000) / 10, gpupool_version());
  int ntraces = argc - 1;

  if (run_main) {
    cudaStream_t s;
    CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    trace_t *traces = calloc((size_t)ntraces + 1, sizeof(trace_t));
    for (int i = 0; i < ntraces; i++) traces[i] = load_trace(argv[i + 1]);

    /* BENCH_ORDER=reverse runs the allocators last to first, to show that the order (which one
     * meets a fresh device first) does not decide a comparison. */
    const char *order = getenv("BENCH_ORDER");
    int reverse = order != NULL && strcmp(order, "reverse") == 0;
    for (int i = 0; i < NALLOC; i++) {
      int a = reverse ? NALLOC - 1 - i : i;
      fprintf(stderr, "bench: %s\n", allocators[a].name);
      bench_hit(a, s);
      bench_random(a, s);
      bench_threads(a);
      for (int i = 0; i < ntraces; i++) bench_replay(a, &traces[i]);
      CUDA(cudaDeviceSynchronize());
      if (allocators[a].reset) allocators[a].reset();
    }

    printf("\n| workload | unit |");
    for (int a = 0; a < NALLOC; a++) printf(" %s |", allocators[a].name);
    printf("\n|---|---|");
    for (int a = 0; a < NALLOC; a++) printf("---|");
    printf("\n");
    for (int r = 0; r < nrows; r++) {
      printf("| %s | %s |", row_name[r], row_unit[r]);
      double g = row_val[r][0];
      for (int a = 0; a < NALLOC; a++) {
        double v = row_val[r][a];
        if (v < 0) {
          printf(" - |");
        } else if (a == 0 || g <= 0) {
          printf(" %.3g |", v);
        } else {
          /* ratio >1: gpupool is better by that factor */
          double ratio = row_lower_better[r] ? v / g : g / v;
          printf(" %.3g (gpupool %.2fx) |", v, ratio);
        }
      }
      printf("\n");
    }
  }
  return run_frag ? bench_frag(ntraces, argv + 1) : 0;
}
