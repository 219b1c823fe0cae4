/* bench_host: pinned host memory. gpupool's caching host allocator (gpupool_host_*) beside
 * cudaHostAlloc/cudaFreeHost, PyTorch's CachingHostAllocator (when built with Torch) and
 * pageable memory (malloc/free, for scale), on two workloads:
 *
 * - hit pair: allocate and free one size, again and again (ns per pair; for cudaHostAlloc and
 *   malloc every pair is a real allocation).
 * - staging: a ring of RING buffers; each step frees the slot's previous buffer, allocates one
 *   of 64 KiB to 4 MiB (cycling through the powers of two), fills it from the host, copies it
 *   to the device with cudaMemcpyAsync on a copy stream and records the copy's event on it
 *   (gpupool_host_record_event, PyTorch's record_event), so that the allocator reuses it only
 *   after the copy. GB/s of the copies, start to the stream's completion.
 *
 * Each figure is the median of REPS runs. BENCH_HOST_FILL=full fills every byte from the host
 * (then the host's memset bandwidth bounds the figure); the default, touch, writes one byte per
 * 4 KiB page. Run: bench_host (GPU_SECTIONS=host scripts/gpu.sh run builds and runs it). */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpupool.h"
#include "cuda_check.h"

#ifdef GPUPOOL_BENCH_TORCH_HOST
void *torch_host_alloc(size_t n);
int torch_host_record_event(void *p, void *stream);
void torch_host_free(void *p);
void torch_host_empty_cache(void);
double torch_host_pair_ns(size_t n, int pairs);
#endif

#define REPS 5
#define RING 8
#define MIN_COPY ((size_t)64 << 10)
#define COPY_SIZES 7 /* 64 KiB .. 4 MiB */

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

typedef struct {
  const char *name;
  void *(*alloc)(size_t n);
  void (*release)(void *p);
  void (*record)(void *p, cudaStream_t s); /* NULL: nothing to tell the allocator */
  int slow;                                /* every call is a real allocation: fewer runs */
  double (*pair_ns)(size_t n, int pairs);  /* the pair loop timed by the allocator's side */
} host_alloc_t;

static void *gp_alloc(size_t n) {
  void *p = NULL;
  if (gpupool_host_malloc(&p, n) != GPUPOOL_SUCCESS) {
    fprintf(stderr, "gpupool_host_malloc: %s\n", gpupool_last_error_message());
    exit(1);
  }
  return p;
}
static void gp_free(void *p) {
  if (gpupool_host_free(p) != GPUPOOL_SUCCESS) {
    fprintf(stderr, "gpupool_host_free: %s\n", gpupool_last_error_message());
    exit(1);
  }
}
static void gp_record(void *p, cudaStream_t s) {
  if (gpupool_host_record_event(p, s) != GPUPOOL_SUCCESS) {
    fprintf(stderr, "gpupool_host_record_event: %s\n", gpupool_last_error_message());
    exit(1);
  }
}
static void *ch_alloc(size_t n) {
  void *p = NULL;
  CUDA(cudaHostAlloc(&p, n, cudaHostAllocDefault));
  return p;
}
static void ch_free(void *p) { CUDA(cudaFreeHost(p)); }
static void *pg_alloc(size_t n) {
  void *p = malloc(n);
  if (!p) exit(1);
  return p;
}
static void pg_free(void *p) { free(p); }
#ifdef GPUPOOL_BENCH_TORCH_HOST
static void pt_record(void *p, cudaStream_t s) {
  if (!torch_host_record_event(p, (void *)s)) {
    fprintf(stderr, "PyTorch's record_event refused %p\n", p);
    exit(1);
  }
}
#endif

static host_alloc_t allocators[] = {
    {"gpupool", gp_alloc, gp_free, gp_record, 0, NULL},
    {"cudaHostAlloc", ch_alloc, ch_free, NULL, 1, NULL},
#ifdef GPUPOOL_BENCH_TORCH_HOST
    /* PyTorch frees a block when its DataPtr dies: its pair loop runs in C++ (torch_host_shim). */
    {"PyTorch", torch_host_alloc, torch_host_free, pt_record, 0, torch_host_pair_ns},
#endif
    {"pageable", pg_alloc, pg_free, NULL, 0, NULL},
};
#define NALLOC ((int)(sizeof allocators / sizeof allocators[0]))

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ns per allocate+free pair of `size` bytes (the block written once, as a caller would). */
static double hit_pair(host_alloc_t *A, size_t size) {
  int pairs = A->slow ? 20 : 200000;
  if (size >= ((size_t)1 << 20) && !A->slow && A->record == NULL) pairs = 20000; /* malloc: mmap each */
  if (A->pair_ns) return A->pair_ns(size, pairs);
  void *warm = A->alloc(size);
  A->release(warm);
  double t0 = now_ns();
  for (int i = 0; i < pairs; i++) {
    volatile char *p = A->alloc(size);
    p[0] = (char)i;
    A->release((void *)p);
  }
  return (now_ns() - t0) / pairs;
}

static int fill_full;

/* GB/s of `total` bytes staged through a ring of RING buffers (see the top of the file). */
static double staging(host_alloc_t *A, cudaStream_t s, void *dev, size_t total) {
  void *ring[RING] = {0};
  size_t bytes = 0;
  double t0 = now_ns();
  for (unsigned i = 0; bytes < total; i++) {
    size_t size = MIN_COPY << (i % COPY_SIZES);
    int slot = (int)(i % RING);
    if (ring[slot]) A->release(ring[slot]);
    char *p = A->alloc(size);
    ring[slot] = p;
    if (fill_full) {
      memset(p, (int)(i & 0xff), size);
    } else {
      for (size_t off = 0; off < size; off += 4096) p[off] = (char)i;
    }
    CUDA(cudaMemcpyAsync(dev, p, size, cudaMemcpyHostToDevice, s));
    if (A->record) A->record(p, s);
    bytes += size;
  }
  CUDA(cudaStreamSynchronize(s));
  double ns = now_ns() - t0;
  for (int k = 0; k < RING; k++)
    if (ring[k]) A->release(ring[k]);
  return (double)bytes / ns; /* bytes per ns = GB/s */
}

int main(void) {
  const char *fill = getenv("BENCH_HOST_FILL");
  fill_full = fill && strcmp(fill, "full") == 0;
  struct cudaDeviceProp prop;
  CUDA(cudaSetDevice(0));
  CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void *dev = NULL;
  CUDA(cudaMalloc(&dev, MIN_COPY << (COPY_SIZES - 1)));

  static const size_t pair_sizes[] = {(size_t)4 << 10, (size_t)16 << 20};
  double pair_ns[2][8], gbs[8];
  {
    /* 1 GiB of copies from a pinned buffer before anything is timed, so that the first
     * allocator does not meet a copy engine and link still waking up. */
    void *warm = NULL;
    CUDA(cudaHostAlloc(&warm, MIN_COPY << (COPY_SIZES - 1), cudaHostAllocDefault));
    for (int k = 0; k < 256; k++)
      CUDA(cudaMemcpyAsync(dev, warm, MIN_COPY << (COPY_SIZES - 1), cudaMemcpyHostToDevice, s));
    CUDA(cudaStreamSynchronize(s));
    CUDA(cudaFreeHost(warm));
  }
  /* BENCH_HOST_ORDER=reverse runs the allocators last to first: a run in each order shows how
   * much the order still moves a figure after the warm-up. */
  const char *order = getenv("BENCH_HOST_ORDER");
  int reverse = order && strcmp(order, "reverse") == 0;
  long long measured_allocs = -1; /* gpupool's cuMemHostAlloc during its measured staging runs */
  for (int i = 0; i < NALLOC; i++) {
    int a = reverse ? NALLOC - 1 - i : i;
    host_alloc_t *A = &allocators[a];
    double v[REPS];
    for (int k = 0; k < 2; k++) {
      for (int r = 0; r < REPS; r++) v[r] = hit_pair(A, pair_sizes[k]);
      pair_ns[k][a] = median(v, REPS);
    }
    size_t total = A->slow ? (size_t)256 << 20 : (size_t)2 << 30;
    staging(A, s, dev, (size_t)64 << 20); /* warm: the ring's blocks exist */
    gpupool_host_stats_t before = GPUPOOL_HOST_STATS_INIT, after = GPUPOOL_HOST_STATS_INIT;
    int counted = A->alloc == gp_alloc && gpupool_host_stats(&before) == GPUPOOL_SUCCESS;
    for (int r = 0; r < REPS; r++) v[r] = staging(A, s, dev, total);
    if (counted && gpupool_host_stats(&after) == GPUPOOL_SUCCESS)
      measured_allocs = (long long)(after.num_host_alloc - before.num_host_alloc);
    gbs[a] = median(v, REPS);
    fprintf(stderr, "bench_host: %s done\n", A->name);
  }
  if (gpupool_host_empty_cache() != GPUPOOL_SUCCESS) fprintf(stderr, "%s\n", gpupool_last_error_message());
#ifdef GPUPOOL_BENCH_TORCH_HOST
  torch_host_empty_cache();
#endif

  printf("bench_host on %s: pinned host memory, median of %d runs; staging ring of %d buffers, 64 KiB-4 MiB, "
         "host fill %s; allocators run %s\n\n",
         prop.name, REPS, RING, fill_full ? "full" : "one byte per 4 KiB page", reverse ? "last to first" : "in order");
  printf("| workload |");
  for (int a = 0; a < NALLOC; a++) printf(" %s |", allocators[a].name);
  printf("\n|---|");
  for (int a = 0; a < NALLOC; a++) printf("---|");
  printf("\n");
  for (int k = 0; k < 2; k++) {
    printf("| allocate+free %s, ns per pair |", k == 0 ? "4 KiB" : "16 MiB");
    for (int a = 0; a < NALLOC; a++) printf(" %.0f |", pair_ns[k][a]);
    printf("\n");
  }
  printf("| staging host-to-device, GB/s |");
  for (int a = 0; a < NALLOC; a++) printf(" %.1f |", gbs[a]);
  printf("\n");
  gpupool_host_stats_t st = GPUPOOL_HOST_STATS_INIT;
  if (gpupool_host_stats(&st) == GPUPOOL_SUCCESS)
    printf("\ngpupool: %lld cuMemHostAlloc (mean %lld us), %lld cuMemFreeHost (mean %lld us), peak %.1f MiB pinned\n",
           (long long)st.num_host_alloc,
           (long long)(st.host_alloc_time.count ? st.host_alloc_time.total / st.host_alloc_time.count : 0),
           (long long)st.num_host_free,
           (long long)(st.host_free_time.count ? st.host_free_time.total / st.host_free_time.count : 0),
           (double)st.allocated_bytes.peak / 1048576.0);
  if (measured_allocs >= 0) printf("gpupool: %lld cuMemHostAlloc during the measured staging runs\n", measured_allocs);
  CUDA(cudaFree(dev));
  CUDA(cudaStreamDestroy(s));
  return 0;
}
