/* bench: gpupool beside cudaMalloc, cudaMallocAsync (default pool, release threshold at its
 * maximum) and, when built with Torch, PyTorch's c10 caching allocator, on the same workloads
 * in one process: the hit path, a random working set, threads on their own streams, and the
 * replay of recorded allocation traces. Prints one table with each figure and its ratio to
 * gpupool's. Usage: bench [trace.txt ...]  (traces in shared/traces format, uncompressed). */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <pthread.h>
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
#endif

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

static void *gp_alloc(size_t n, cudaStream_t s) {
  void *p = NULL;
  if (gpupool_malloc(&p, n, 0, (gpupool_stream_t)s) != GPUPOOL_SUCCESS) {
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

/* --- random working set (after RMM's random_allocations) --- */
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
  int ops;
  pthread_barrier_t *start;
} thread_arg;

static void *thread_body(void *v) {
  thread_arg *t = v;
  void *live[16];
  uint64_t rng = (uint64_t)(uintptr_t)t->s | 1;
  for (int k = 0; k < 16; k++) live[k] = t->A->alloc((size_t)4096 << (k % 9), t->s);
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

static void bench_threads(int ai) {
  allocator_t *A = &allocators[ai];
  int counts[] = {1, 4, 16};
  const char *names[] = {"1 thread", "4 threads", "16 threads"};
  for (int c = 0; c < 3; c++) {
    int n = counts[c], ops = A->slow ? 400 : 200000;
    pthread_t th[16];
    thread_arg args[16];
    cudaStream_t streams[16];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    for (int t = 0; t < n; t++) {
      CUDA(cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking));
      args[t] = (thread_arg){A, streams[t], ops, &start};
      pthread_create(&th[t], NULL, thread_body, &args[t]);
    }
    pthread_barrier_wait(&start);
    double t0 = now_ns();
    pthread_barrier_wait(&start);
    double secs = (now_ns() - t0) / 1e9;
    for (int t = 0; t < n; t++) pthread_join(th[t], NULL);
    CUDA(cudaDeviceSynchronize());
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

/* The trace from an empty cache ("cold": the model's first step, when segments come from the
 * driver), then again with what the first pass left cached ("warm": every later step, the
 * allocator's own cost). Reserved/live and device allocations are the cold pass's, comparable
 * with the figures PyTorch recorded with the traces. */
static void bench_replay(int ai, trace_t *t) {
  allocator_t *A = &allocators[ai];
  if (A->slow) return; /* minutes per trace; GPU.md and the traces' README give its figures */
  void **ptr = calloc(t->max_id + 1, sizeof(void *));
  size_t *size = calloc(t->max_id + 1, sizeof(size_t));
  int *owner = calloc(t->max_id + 1, sizeof(int));
  cudaStream_t streams[64];
  for (int k = 0; k < t->nstreams; k++) CUDA(cudaStreamCreateWithFlags(&streams[k], cudaStreamNonBlocking));
  if (A->reset) A->reset();
  long long peak_live = 0, allocs0 = A->device_allocs ? A->device_allocs() : 0;
  double cold = replay_pass(A, t, streams, ptr, size, owner, &peak_live);
  long long allocs = A->device_allocs ? A->device_allocs() - allocs0 : -1;
  long long reserved = A->reserved_peak ? A->reserved_peak() : -1;
  double warm = replay_pass(A, t, streams, ptr, size, owner, &peak_live);
  CUDA(cudaDeviceSynchronize());
  char name[64];
  snprintf(name, sizeof name, "replay %s", t->name);
  row_val[row(name, "ns/event", 1)][ai] = cold;
  if (allocs >= 0) row_val[row(name, "device allocs", 1)][ai] = (double)allocs;
  snprintf(name, sizeof name, "replay %s warm", t->name);
  row_val[row(name, "ns/event", 1)][ai] = warm;
  snprintf(name, sizeof name, "replay %s", t->name);
  if (reserved >= 0) row_val[row(name, "reserved/live", 1)][ai] = (double)reserved / (double)peak_live;
  for (int k = 0; k < t->nstreams; k++) CUDA(cudaStreamDestroy(streams[k]));
  free(ptr);
  free(size);
  free(owner);
}

int main(int argc, char **argv) {
  CUDA(cudaSetDevice(0));
  CUDA(cudaFree(NULL));
  CUDA(cudaDeviceGetDefaultMemPool(&async_pool, 0));
  uint64_t max = UINT64_MAX;
  CUDA(cudaMemPoolSetAttribute(async_pool, cudaMemPoolAttrReleaseThreshold, &max));
#ifdef GPUPOOL_BENCH_TORCH
  torch_init();
#endif
  struct cudaDeviceProp prop;
  CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0;
  CUDA(cudaDriverGetVersion(&driver));
  printf("bench: %s, CUDA driver %d.%d, gpupool %s\n", prop.name, driver / 1000, (driver % 1000) / 10, gpupool_version());

  cudaStream_t s;
  CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int ntraces = argc - 1;
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
  return 0;
}
