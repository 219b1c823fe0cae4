/* bench's trace replay (bench.h): traces read from files or made from the random working
 * set, each replayed cold and then warm. */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"

trace_t load_trace(const char *path) {
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


/* The trace from an empty cache ("cold": the model's first step, when segments come from the
 * driver), then again with what the first pass left cached ("warm": every later step, the
 * allocator's own cost). Reserved and device allocations are the cold pass's, comparable with
 * the figures PyTorch recorded with the traces. */
replay_result_t replay_twice(allocator_t *A, trace_t *t) {
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

/* The random working set of bench_random as a trace (the same generator and seed, so the same
 * sizes in the same order), for the fragmentation table. */
trace_t random_trace(void) {
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

