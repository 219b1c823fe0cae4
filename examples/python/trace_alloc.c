/* trace_alloc: a PyTorch CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator) that writes
 * every request it serves to a trace in the format of shared/traces, and serves it with
 * cudaMallocAsync/cudaFreeAsync on the stream PyTorch names. record_trace.py builds it with
 *
 *   gcc -O2 -shared -fPIC trace_alloc.c -o libtrace_alloc.so <libcudart>
 *
 * and loads it. The trace, one event a line:
 *
 *   a ID SIZE STREAM   SIZE bytes as PyTorch asked for them (before any rounding) on STREAM
 *                      (the cudaStream_t as an integer, 0 for the legacy default stream)
 *   f ID               the allocation ID given back
 *
 * IDs count from 0 and are never reused. Requests of 0 bytes are served (1 byte) but not
 * written: PyTorch's own allocator never sees them (it returns NULL for them itself), and the
 * traces are what its allocator sees.
 *
 * trace_open(path) starts the trace, once per process (call it before the first CUDA tensor);
 * trace_close() writes it out and stops it; requests after that are served and not written. Every function
 * is thread-safe: one lock orders the events, since autograd runs the backward pass on a
 * thread of its own. cudaMallocAsync is the serving allocator because it is stream-ordered like
 * PyTorch's (a block freed on its stream is safe to reuse there at once), fast enough not to
 * change the workload's pace much, and not gpupool, so that the trace owes nothing to the
 * allocator under study. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* The CUDA runtime's calls used, declared here so that the build needs no CUDA header; the
 * library links against the libcudart that PyTorch loads (same soname, so the same copy). */
typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream);
cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream);
const char *cudaGetErrorString(cudaError_t error);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *out;
static long long events;
static uint64_t next_id;

/* Live allocations: pointer -> ID, open addressing with linear probing (key 0: empty). */
typedef struct {
  uintptr_t key;
  uint64_t id;
} slot_t;
static slot_t *table;
static size_t cap, used;

static size_t home(uintptr_t key) { return (size_t)(((uint64_t)key >> 8) * 0x9E3779B97F4A7C15ULL) & (cap - 1); }

static int table_grow(void) {
  size_t old_cap = cap;
  slot_t *old = table;
  size_t new_cap = cap ? cap * 2 : 1 << 16;
  slot_t *fresh = calloc(new_cap, sizeof(slot_t));
  if (fresh == NULL) return -1;
  table = fresh;
  cap = new_cap;
  for (size_t i = 0; i < old_cap; i++) {
    if (old[i].key == 0) continue;
    size_t j = home(old[i].key);
    while (table[j].key != 0) j = (j + 1) & (cap - 1);
    table[j] = old[i];
  }
  free(old);
  return 0;
}

static int table_put(uintptr_t key, uint64_t id) {
  if ((used + 1) * 2 > cap && table_grow() != 0) return -1;
  size_t j = home(key);
  while (table[j].key != 0) j = (j + 1) & (cap - 1);
  table[j] = (slot_t){key, id};
  used++;
  return 0;
}

/* Removes key; returns 1 and its ID in *id when it was there. Deletion shifts the following
 * entries of the probe run back, so no tombstones accumulate. */
static int table_take(uintptr_t key, uint64_t *id) {
  if (cap == 0) return 0;
  size_t j = home(key);
  while (table[j].key != key) {
    if (table[j].key == 0) return 0;
    j = (j + 1) & (cap - 1);
  }
  *id = table[j].id;
  size_t hole = j;
  for (size_t k = (j + 1) & (cap - 1); table[k].key != 0; k = (k + 1) & (cap - 1)) {
    size_t h = home(table[k].key);
    /* table[k] may move into the hole when its home is not in (hole, k], cyclically */
    int stays = hole <= k ? (hole < h && h <= k) : (hole < h || h <= k);
    if (!stays) {
      table[hole] = table[k];
      hole = k;
    }
  }
  table[hole].key = 0;
  used--;
  return 1;
}

/* Starts writing the trace to path (replacing the file); once per process, since IDs and the
 * table of live allocations carry on. Returns 0, or -1 when the file cannot be opened (errno
 * set by fopen) or a trace was opened before. */
int trace_open(const char *path) {
  static int opened;
  pthread_mutex_lock(&lock);
  int rc = -1;
  if (!opened) {
    opened = 1;
    out = fopen(path, "w");
    if (out != NULL) {
      setvbuf(out, NULL, _IOFBF, 1 << 20);
      events = 0;
      rc = 0;
    }
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

/* Writes the trace out and closes it. Returns the number of events written, or -1 when no
 * trace was open or writing failed. */
long long trace_close(void) {
  pthread_mutex_lock(&lock);
  long long n = -1;
  if (out != NULL) {
    int failed = ferror(out) != 0;
    failed |= fclose(out) != 0;
    out = NULL;
    n = failed ? -1 : events;
  }
  pthread_mutex_unlock(&lock);
  return n;
}

/* PyTorch's pluggable-allocator signature: bytes, device, stream. Returns NULL when
 * cudaMallocAsync fails (PyTorch then raises its out-of-memory error). */
void *trace_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)device; /* PyTorch makes the device current before it calls */
  void *p = NULL;
  cudaError_t e = cudaMallocAsync(&p, size > 0 ? (size_t)size : 1, stream);
  if (e != 0) {
    fprintf(stderr, "trace_alloc: cudaMallocAsync(%zd bytes): %s\n", size, cudaGetErrorString(e));
    return NULL;
  }
  if (size <= 0) return p;
  pthread_mutex_lock(&lock);
  if (out != NULL) {
    uint64_t id = next_id++;
    if (table_put((uintptr_t)p, id) != 0) {
      fprintf(stderr, "trace_alloc: out of host memory for the table; the trace stops here\n");
      fclose(out);
      out = NULL;
    } else {
      fprintf(out, "a %llu %lld %llu\n", (unsigned long long)id, (long long)size,
              (unsigned long long)(uintptr_t)stream);
      events++;
    }
  }
  pthread_mutex_unlock(&lock);
  return p;
}

/* PyTorch's pluggable-allocator signature: pointer, bytes, device, and the stream it was
 * allocated on, which is where cudaFreeAsync orders the free. */
void trace_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  if (ptr == NULL) return;
  pthread_mutex_lock(&lock);
  uint64_t id = 0;
  if (table_take((uintptr_t)ptr, &id) && out != NULL) {
    fprintf(out, "f %llu\n", (unsigned long long)id);
    events++;
  }
  pthread_mutex_unlock(&lock);
  cudaError_t e = cudaFreeAsync(ptr, stream);
  /* cudaErrorCudartUnloading (4): tensors freed at interpreter exit, after the runtime has
   * begun to shut down and takes the memory back itself. */
  if (e != 0 && e != 4) fprintf(stderr, "trace_alloc: cudaFreeAsync(%p): %s\n", ptr, cudaGetErrorString(e));
}
