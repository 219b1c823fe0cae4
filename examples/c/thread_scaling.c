/* How gpupool's throughput grows with threads, apart from the GPU: T threads, each on its own
 * stream of device t % D, run bench.c's threads loop (16 live blocks, each freed and allocated
 * again at a size of 4 KiB to 1 MiB drawn at random, OPS operations a thread) and the total
 * rate is printed in million operations a second. Run it on the simulated device to measure
 * the host and gpupool alone (the streams are made-up handles, which a GPU would refuse):
 *
 *   GPUPOOL_DRIVER=sim GPUPOOL_SIM_DEVICES=16 GPUPOOL_SIM_CAPACITY=16GiB ./thread_scaling T D [OPS]
 *
 * D = 1 puts every thread on one device (they share its statistics and peak credit); D = T gives
 * each its own (docs/performance.md compares the two on the GPU machine's host). D = 0 calls no
 * gpupool function: each thread runs the host's control instead, a loop of about the hit
 * pair's length (CONTROL_STEPS xorshift steps, each stored into a 64 KiB array of the
 * thread's own) per "operation", sharing nothing, so that its rate at T threads against one
 * thread is what the host's cores give any work that shares nothing (their clocks under load,
 * hyper-threads), the ceiling for gpupool's ratio on the same host. It also prints
 * how many calls of the timed loop settled the peak statistics (gpupool_peak_settles), per
 * million calls: the shared work that exact peaks cost the threads of one device. That function
 * is looked up when the program starts, so that the same program runs against a library from
 * before it (scripts/gpu.sh section threads compares the two), printing "n/a" there. */
#include <dlfcn.h>
#include <gpupool.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { LIVE = 16, MAX_THREADS = 256, CONTROL_STEPS = 48, CONTROL_WORDS = 8192 };

static int ops = 400000, devices = 1;
static pthread_barrier_t start;

static uint64_t rng_next(uint64_t *s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void ok(gpupool_status s);

typedef gpupool_status (*peak_settles_fn)(int, int64_t *);
static peak_settles_fn peak_settles;

/* Peak settles of every device the threads use, so far (0 without gpupool_peak_settles). */
static int64_t settles(void) {
  int64_t total = 0;
  for (int d = 0; peak_settles && d < devices; d++) {
    int64_t n = 0;
    ok(peak_settles(d, &n));
    total += n;
  }
  return total;
}

static void ok(gpupool_status s) {
  if (s != GPUPOOL_SUCCESS) {
    fprintf(stderr, "thread_scaling: %s\n", gpupool_last_error_message());
    exit(1);
  }
}

/* The host's control (D = 0): the same barriers and operation count as `body`, no gpupool call.
 * Its array's checksum goes to `control_sums` so that the loop is not optimised away. */
static uint64_t control_sums[MAX_THREADS];
static void *control(void *arg) {
  uintptr_t t = (uintptr_t)arg;
  uint64_t *words = calloc(CONTROL_WORDS, sizeof *words), rng = (t + 1) * 0x9e3779b97f4a7c15ULL | 1;
  if (!words) {
    fprintf(stderr, "thread_scaling: no memory for the control's array\n");
    exit(1);
  }
  pthread_barrier_wait(&start);
  pthread_barrier_wait(&start);
  for (int i = 0; i < ops / 2; i++)
    for (int k = 0; k < CONTROL_STEPS; k++) {
      uint64_t x = rng_next(&rng);
      words[x % CONTROL_WORDS] += x;
    }
  pthread_barrier_wait(&start);
  for (int k = 0; k < CONTROL_WORDS; k++) control_sums[t] += words[k];
  free(words);
  return NULL;
}

static void *body(void *arg) {
  uintptr_t t = (uintptr_t)arg;
  int device = (int)(t % (uintptr_t)devices);
  gpupool_stream_t stream = (gpupool_stream_t)(0x1000 * (t + 1));
  void *live[LIVE];
  uint64_t rng = (t + 1) * 0x9e3779b97f4a7c15ULL | 1;
  for (int k = 0; k < LIVE; k++) ok(gpupool_malloc(&live[k], (size_t)4096 << (k % 9), device, stream));
  /* Twice: the settles are counted in between, after every thread's first blocks. */
  pthread_barrier_wait(&start);
  pthread_barrier_wait(&start);
  for (int i = 0; i < ops / 2; i++) {
    int k = i % LIVE;
    ok(gpupool_free(live[k]));
    ok(gpupool_malloc(&live[k], (size_t)4096 << (rng_next(&rng) % 9), device, stream));
  }
  pthread_barrier_wait(&start);
  for (int k = 0; k < LIVE; k++) ok(gpupool_free(live[k]));
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: thread_scaling THREADS DEVICES [OPS]\n");
    return 2;
  }
  int threads = atoi(argv[1]);
  devices = atoi(argv[2]);
  if (argc > 3) ops = atoi(argv[3]);
  if (threads < 1 || threads > MAX_THREADS || devices < 0 || ops < 2) {
    fprintf(stderr, "thread_scaling: 1 to %d threads, 0 devices (the host's control) or more, and at least 2 operations\n",
            MAX_THREADS);
    return 2;
  }
  /* memcpy: ISO C has no cast from dlsym's object pointer to a function pointer. */
  void *self = dlopen(NULL, RTLD_LAZY);
  void *sym = self ? dlsym(self, "gpupool_peak_settles") : NULL;
  memcpy(&peak_settles, &sym, sizeof peak_settles);
  pthread_t th[MAX_THREADS];
  pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
  for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, devices ? body : control, (void *)(uintptr_t)t);
  pthread_barrier_wait(&start);
  int64_t settled = settles();
  pthread_barrier_wait(&start);
  double t0 = now_s();
  pthread_barrier_wait(&start);
  double seconds = now_s() - t0;
  settled = settles() - settled;
  for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
  pthread_barrier_destroy(&start);
  double calls = (double)threads * ops;
  if (devices == 0) {
    uint64_t sum = 0;
    for (int t = 0; t < threads; t++) sum ^= control_sums[t];
    printf("thread_scaling: %d thread(s), the host's control (no gpupool call; checksum %llx): %.2f M ops/s\n", threads,
           (unsigned long long)(sum & 0xfff), calls / seconds / 1e6);
    return 0;
  }
  char rate[32] = "n/a";
  if (peak_settles) snprintf(rate, sizeof rate, "%.1f", (double)settled / calls * 1e6);
  printf("thread_scaling: %d thread(s) on %d device(s): %.2f M ops/s, %s peak settles per million calls\n",
         threads, devices, calls / seconds / 1e6, rate);
  return 0;
}
