/* The LD_PRELOAD shim (libgpupool_preload.so) on the simulated device, with no CUDA installed:
 * the program finds cudaMalloc and friends with dlsym, as the dynamic linker would bind them,
 * and gets the shim's. Run as
 *   LD_PRELOAD=libgpupool_preload.so GPUPOOL_DRIVER=sim GPUPOOL_SIM_CAPACITY=64MiB \
 *     GPUPOOL_PRELOAD_MODE=safe|stream ./test_preload safe|stream
 * Exit status 0 when every check passed; 77 (skipped) without the shim preloaded. It runs
 * itself once more, as `test_preload report`, to read the shim's exit report. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpupool.h"

/* Not linked with libgpupool: check.h's messages come from the shim's copy of gpupool. */
static const char *shim_last_error(void) {
  const char *(*f)(void) = NULL;
  *(void **)(&f) = dlsym(RTLD_DEFAULT, "gpupool_last_error_message");
  return f ? f() : "(no shim)";
}
#define gpupool_last_error_message shim_last_error
#include "check.h"
#include "child_report.h"

#define MIB ((size_t)1 << 20)

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*malloc_async_fn)(void **, size_t, void *);
typedef int (*free_async_fn)(void *, void *);
typedef int (*cu_alloc_fn)(uint64_t *, size_t);
typedef int (*cu_free_fn)(uint64_t);
typedef int (*cu_free_async_fn)(uint64_t, void *);
typedef int (*cu_get_proc_fn)(const char *, void **, int, uint64_t, int *);
typedef gpupool_status (*stats_fn)(int, gpupool_stats_t *);
typedef int (*host_alloc_fn)(void **, size_t, unsigned);
typedef gpupool_status (*host_stats_fn)(gpupool_host_stats_t *);

static stats_fn get_stats;

/* dlsym's object pointer into a function pointer, the way POSIX allows under -Wpedantic. */
#define LOOKUP(fn, name) (*(void **)(&(fn)) = dlsym(RTLD_DEFAULT, name))

/* stderr goes to a temporary file from capture_begin to capture_end, which returns how many
 * bytes were written to it: the shim must print nothing where CUDA would print nothing. */
static FILE *captured;
static int saved_stderr = -1;

static void capture_begin(void) {
  fflush(stderr);
  captured = tmpfile();
  saved_stderr = dup(2);
  if (captured) dup2(fileno(captured), 2);
}

static long capture_end(void) {
  fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  if (!captured) return -1;
  fseek(captured, 0, SEEK_END);
  long n = ftell(captured);
  fclose(captured);
  return n;
}

/* The frees of `test_preload report`, run by check_exit_report in a child process with
 * GPUPOOL_PRELOAD_STATS=on: one taken and two refused by cudaFree, one taken and one refused by
 * cudaFreeAsync; and one cuMemCreate. Its exit report goes to stderr, which the parent reads. */
static int report_child(malloc_fn cuda_malloc, free_fn cuda_free, malloc_async_fn cuda_malloc_async,
                        free_async_fn cuda_free_async) {
  void *p = NULL, *a = NULL;
  CHECK(cuda_malloc(&p, 1000) == 0);
  CHECK(cuda_free((char *)p + 512) == 1); /* inside the block: refused */
  CHECK(cuda_free(p) == 0);
  CHECK(cuda_free(p) == 1); /* freed already: refused */
  CHECK(cuda_malloc_async(&a, 1 << 20, (void *)0x10) == 0);
  CHECK(cuda_free_async(a, (void *)0x20) == 0);
  CHECK(cuda_free_async(a, (void *)0x20) == 1);
  /* cuMemCreate, as ggml's VMM pool calls it: the driver's (none here: not initialised, 3),
   * counted in the report. */
  int (*cu_mem_create)(unsigned long long *, size_t, const void *, unsigned long long) = NULL;
  LOOKUP(cu_mem_create, "cuMemCreate");
  unsigned long long handle = 0;
  CHECK(cu_mem_create != NULL && cu_mem_create(&handle, 2 * MIB, NULL, 0) == 3);
  return checks_report("test_preload (exit report child)");
}

/* Whether the `len` bytes at `data` hold the `n` bytes of `what`. */
static int holds(const char *data, size_t len, const char *what) {
  size_t n = strlen(what);
  for (size_t i = 0; i + n <= len; i++)
    if (memcmp(data + i, what, n) == 0) return 1;
  return 0;
}

/* The snapshot the report child wrote at exit: PyTorch's pickle (protocol 2 or later, opcode
 * PROTO first) with the keys its viewer reads and the child's allocations and frees in the
 * trace (tests/capi/history.rs reads one back value by value). */
static void check_snapshot_file(const char *path) {
  static char data[1 << 16];
  FILE *f = fopen(path, "rb");
  CHECK(f != NULL);
  if (!f) return;
  size_t len = fread(data, 1, sizeof data, f);
  fclose(f);
  CHECK(len > 2 && (unsigned char)data[0] == 0x80);
  /* No free_completed: in the safe mode the child's cudaFree waits for a device synchronisation. */
  const char *keys[] = {"segments", "device_traces", "segment_map", "alloc", "free_requested"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    CHECK(holds(data, len, keys[i]));
    if (!holds(data, len, keys[i])) fprintf(stderr, "no %s in %s\n", keys[i], path);
  }
}

/* Runs this program as `test_preload report` under the same LD_PRELOAD with
 * GPUPOOL_PRELOAD_STATS=on, and checks its exit report: a free is counted only when gpupool
 * took it, a refused one apart; and the snapshot it writes at exit (GPUPOOL_SNAPSHOT_AT_EXIT). */
static void check_exit_report(void) {
  static char report[1 << 16];
  /* The child also records its history and writes its snapshot at exit (the shim's allocator is
   * the process-wide one, whose GPUPOOL_SNAPSHOT_AT_EXIT this is). */
  char snapshot[128];
  snprintf(snapshot, sizeof snapshot, "/tmp/gpupool_test_preload_%d.pickle", (int)getpid());
  remove(snapshot);
  setenv("GPUPOOL_RECORD_HISTORY", "1000:none", 1);
  setenv("GPUPOOL_SNAPSHOT_AT_EXIT", snapshot, 1);
  CHECK(child_report("test_preload", report, sizeof report));
  unsetenv("GPUPOOL_RECORD_HISTORY");
  unsetenv("GPUPOOL_SNAPSHOT_AT_EXIT");
  check_snapshot_file(snapshot);
  remove(snapshot);
  int before = checks_failed;
  CHECK(strstr(report, "gpupool_preload: served 1 cudaMalloc, 1 cudaMallocAsync, 0 cuMemAlloc, 0 cuMemAllocAsync\n"
                       "gpupool_preload: 1 frees, 1 stream-ordered frees; refused 2 frees and 1 stream-ordered "
                       "frees\n") != NULL);
  CHECK(strstr(report, "gpupool_preload: passed through 1 cuMemCreate (0 MiB created)\n") != NULL);
  CHECK(strstr(report, "gpupool_preload: option GPUPOOL_PRELOAD_STATS=on\n") != NULL);
  CHECK(strstr(report, "gpupool memory summary, device ID 0") != NULL);
  if (checks_failed != before) fprintf(stderr, "the child's stderr:\n%s\n", report);
}

/* Pinned host memory: cudaMallocHost, cudaHostAlloc and the driver's cuMemHostAlloc served by
 * gpupool's host allocator; a block freed with cudaFreeHost is reused only after a device
 * synchronisation (made when an allocation of its size finds no other block). */
static void check_pinned(void) {
  malloc_fn cuda_malloc_host = NULL;
  host_alloc_fn cuda_host_alloc = NULL, cu_host_alloc = NULL;
  free_fn cuda_free_host = NULL, cu_free_host = NULL;
  host_stats_fn get_host_stats = NULL;
  LOOKUP(cuda_malloc_host, "cudaMallocHost");
  LOOKUP(cuda_host_alloc, "cudaHostAlloc");
  LOOKUP(cuda_free_host, "cudaFreeHost");
  LOOKUP(cu_host_alloc, "cuMemHostAlloc");
  LOOKUP(cu_free_host, "cuMemFreeHost");
  LOOKUP(get_host_stats, "gpupool_host_stats");
  CHECK(cuda_malloc_host && cuda_host_alloc && cuda_free_host && cu_host_alloc && cu_free_host && get_host_stats);
  if (!cuda_malloc_host || !cuda_host_alloc || !cuda_free_host || !cu_host_alloc || !cu_free_host || !get_host_stats)
    return;
  gpupool_host_stats_t hs = GPUPOOL_HOST_STATS_INIT;
  void *h = NULL, *other = NULL, *again = NULL, *d = NULL;
  CHECK(cuda_malloc_host(&h, 1000) == 0);
  CHECK(h != NULL);
  if (h) memset(h, 0x11, 1024); /* rounded up to 1 KiB, all the caller's */
  CHECK(cuda_malloc_host(NULL, 16) == 1);
  CHECK(cuda_free_host((char *)h + 8) == 1); /* inside a block: refused */
  CHECK(cuda_free_host(h) == 0);
  CHECK(cuda_free_host(h) == 1); /* freed already */
  /* Another size: no reason to synchronise; h still waits (counted active). */
  CHECK(cuda_host_alloc(&other, 5000, 1 /* cudaHostAllocPortable */) == 0);
  CHECK(other != h);
  CHECK(get_host_stats(&hs) == GPUPOOL_SUCCESS);
  CHECK(hs.active_requests.current == 2);
  /* h's size: gpupool synchronises the device, then hands h out again. */
  CHECK(cuda_malloc_host(&again, 700) == 0);
  CHECK(again == h);
  CHECK(cuda_free_host(again) == 0);
  CHECK(cuda_free_host(other) == 0);
  /* The driver API's. */
  CHECK(cu_host_alloc(&d, 4096, 0) == 0);
  CHECK(d != NULL);
  CHECK(cu_free_host(d) == 0);
  /* Mapped memory is another kind: the real function's, absent here (cudaErrorUnknown). */
  void *mapped = NULL;
  CHECK(cuda_host_alloc(&mapped, 4096, 2 /* cudaHostAllocMapped */) == 999);
  CHECK(get_host_stats(&hs) == GPUPOOL_SUCCESS);
  CHECK(hs.num_host_alloc == 3);
}

static gpupool_stats_t stats(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK(get_stats(0, &s) == GPUPOOL_SUCCESS);
  return s;
}

int main(int argc, char **argv) {
  int stream_mode = argc > 1 && strcmp(argv[1], "stream") == 0;
  malloc_fn cuda_malloc = NULL;
  free_fn cuda_free = NULL;
  malloc_async_fn cuda_malloc_async = NULL;
  free_async_fn cuda_free_async = NULL;
  cu_alloc_fn cu_alloc = NULL;
  cu_free_fn cu_free = NULL;
  cu_free_async_fn cu_free_async = NULL;
  cu_get_proc_fn cu_get_proc = NULL;
  LOOKUP(cuda_malloc, "cudaMalloc");
  LOOKUP(cuda_free, "cudaFree");
  LOOKUP(cuda_malloc_async, "cudaMallocAsync");
  LOOKUP(cuda_free_async, "cudaFreeAsync");
  LOOKUP(cu_alloc, "cuMemAlloc_v2");
  LOOKUP(cu_free, "cuMemFree_v2");
  LOOKUP(cu_free_async, "cuMemFreeAsync");
  LOOKUP(cu_get_proc, "cuGetProcAddress_v2");
  LOOKUP(get_stats, "gpupool_stats");
  if (!cuda_malloc || !cuda_free || !cuda_malloc_async || !cuda_free_async || !cu_alloc || !cu_free ||
      !cu_free_async || !cu_get_proc || !get_stats) {
    printf("test_preload: skipped: libgpupool_preload.so is not preloaded\n");
    return 77;
  }
  if (argc > 1 && strcmp(argv[1], "report") == 0)
    return report_child(cuda_malloc, cuda_free, cuda_malloc_async, cuda_free_async);

  /* cudaMalloc is served by gpupool: the memory is the simulated device's (host memory). */
  void *p = NULL;
  CHECK(cuda_malloc(&p, 1000) == 0);
  CHECK(p != NULL && (uintptr_t)p % 512 == 0);
  if (p) memset(p, 0xab, 1000);
  CHECK(stats().allocation.all.current == 1);
  CHECK(cuda_malloc(NULL, 16) == 1); /* cudaErrorInvalidValue */

  /* cudaFree: in safe mode the block waits for a device synchronisation, so the next
   * allocation of the same size gets another block; in stream mode it is reused at once. */
  CHECK(cuda_free(p) == 0);
  void *q = NULL;
  CHECK(cuda_malloc(&q, 1000) == 0);
  if (stream_mode) {
    CHECK(q == p);
    CHECK(stats().allocation.all.current == 1);
  } else {
    CHECK(q != p);
    /* p is still held: no longer allocated, but active until a device synchronisation */
    CHECK(stats().allocation.all.current == 1);
    CHECK(stats().active.all.current == 2);
  }
  CHECK(cuda_free(q) == 0);
  CHECK(cuda_free(q) == 1); /* a second free of the same block is refused */

  /* Out of memory with deferred blocks: the shim synchronises, releases them and retries. */
  void *big = NULL, *big2 = NULL;
  CHECK(cuda_malloc(&big, 40 * MIB) == 0);
  CHECK(cuda_free(big) == 0);
  CHECK(cuda_malloc(&big2, 40 * MIB) == 0); /* 64 MiB device: fits only once big is back */
  CHECK(big2 == big);
  CHECK(cuda_free(big2) == 0);
  void *huge = (void *)0x1;
  CHECK(cuda_malloc(&huge, 100 * MIB) == 2); /* cudaErrorMemoryAllocation */

  /* The driver API: served too (the simulated device's context counts as primary). */
  uint64_t d = 0;
  CHECK(cu_alloc(&d, 4096) == 0);
  CHECK(d != 0);
  CHECK(cu_free(d) == 0);

  /* Stream-ordered: cudaFreeAsync on another stream is never deferred. */
  void *a = NULL;
  gpupool_stats_t before = stats();
  CHECK(cuda_malloc_async(&a, 1 << 20, (void *)0x10) == 0);
  CHECK(cuda_free_async(a, (void *)0x20) == 0);
  CHECK(stats().allocation.all.current == before.allocation.all.current);

  /* Pointers that are not gpupool's go to the real function, absent here (no CUDA runtime):
   * cudaErrorUnknown, and gpupool is untouched. */
  before = stats();
  CHECK(cuda_free((void *)0x1234) == 999);
  CHECK(stats().allocation.all.current == before.allocation.all.current);

  /* cudaFree(NULL) does nothing and succeeds, as CUDA's does; on the simulated device the
   * shim answers it without a runtime. */
  CHECK(cuda_free(NULL) == 0);
  CHECK(stats().allocation.all.current == before.allocation.all.current);

  /* Without libcuda, a driver call the shim does not serve has no driver to go to: the shim
   * answers CUDA_ERROR_NOT_INITIALIZED (3), as the driver does before cuInit has succeeded,
   * and prints nothing. On a machine with libcuda these calls reach the real driver. */
  void *libcuda = dlopen("libcuda.so.1", RTLD_LAZY);
  if (libcuda == NULL) {
    before = stats();
    capture_begin();
    int null_free = cu_free(0);
    int foreign_free = cu_free(0x1234);
    int foreign_free_async = cu_free_async(0x1234, NULL);
    void *fn = NULL;
    int found = 0;
    int lookup = cu_get_proc("cuMemAlloc", &fn, 12080, 0, &found);
    /* Stream destroys (streams.rs): retired first, then no driver (3) and no runtime (999). */
    free_fn cu_stream_destroy = NULL, cuda_stream_destroy = NULL;
    LOOKUP(cu_stream_destroy, "cuStreamDestroy_v2");
    LOOKUP(cuda_stream_destroy, "cudaStreamDestroy");
    int destroyed = cu_stream_destroy ? cu_stream_destroy((void *)0x1234) : -1;
    int destroyed_rt = cuda_stream_destroy ? cuda_stream_destroy((void *)0x1234) : -1;
    long printed = capture_end();
    CHECK(null_free == 3);
    CHECK(foreign_free == 3);
    CHECK(foreign_free_async == 3);
    CHECK(lookup == 3);
    CHECK(fn == NULL);
    CHECK(destroyed == 3 && destroyed_rt == 999);
    CHECK(printed == 0);
    CHECK(stats().allocation.all.current == before.allocation.all.current);
  } else {
    dlclose(libcuda);
    printf("test_preload: libcuda.so.1 is present: the checks without a driver are skipped\n");
  }

  check_pinned();
  check_exit_report();
  return checks_report(stream_mode ? "test_preload (stream)" : "test_preload (safe)");
}
