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
#include "bench.h"

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

allocator_t allocators[] = {
    {"gpupool", gp_alloc, gp_free, gp_peak, gp_reset, gp_device_allocs, 0},
#ifdef GPUPOOL_BENCH_TORCH
    {"pytorch", pt_alloc, pt_free, torch_reserved_peak, pt_reset, torch_device_allocs, 0},
#endif
    {"cudaMallocAsync", ca_alloc, ca_free, ca_peak, ca_reset, NULL, 0},
    {"cudaMalloc", cm_alloc, cm_free, NULL, NULL, NULL, 1},
};
const int nalloc = (int)(sizeof allocators / sizeof allocators[0]);
#define NALLOC nalloc

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

/* --- trace replay (bench_replay.c) --- */
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

void cuda_setup(int with_torch) {
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

char self_path[4096];

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
