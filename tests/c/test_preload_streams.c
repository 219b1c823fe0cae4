/* The LD_PRELOAD shim's stream destroys (preload/src/streams.rs) on the simulated device, with
 * the stand-in driver and runtime of test_preload_dlopen (standin_libcuda.c,
 * standin_libcudart.c), which count the destroys that reach them. gpupool keys cached blocks
 * by stream handle, and CUDA gives a destroyed stream's handle to the next stream created
 * while the old one's work may run: so under the shim, a destroy of a stream gpupool served
 * must be preceded by a retire that waits for the stream, one of a stream it never served must
 * not wait, and the real destroy must run with its status returned unchanged. Run as
 *   LD_PRELOAD=libgpupool_preload.so GPUPOOL_DRIVER=sim LD_LIBRARY_PATH=<stand-ins> \
 *     ./test_preload_streams
 * Exit status 0 when every check passed; 77 (skipped) without the shim preloaded. It runs
 * itself again as `test_preload_streams report` (the destroys, counted in the exit report) and
 * as `test_preload_streams unstarted` (a destroy before gpupool has started: no report). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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

typedef int (*destroy_fn)(void *);
typedef int (*cu_alloc_async_fn)(uint64_t *, size_t, void *);
typedef int (*cu_free_async_fn)(uint64_t, void *);
typedef int (*malloc_async_fn)(void **, size_t, void *);
typedef int (*free_async_fn)(void *, void *);
typedef int (*get_proc_fn)(const char *, void **, int, uint64_t);
typedef int (*get_proc_v2_fn)(const char *, void **, int, uint64_t, int *);
typedef int (*entry_fn)(const char *, void **, uint64_t, int *);
typedef int (*entry_by_version_fn)(const char *, void **, unsigned, uint64_t, int *);

/* A function pointer held as dlsym's void *, called through its type (POSIX's way under
 * -Wpedantic). */
#define CALL(type, p) (*(type *)(&(p)))

/* The shim's own definition of `name`: the global scope's, where the preloaded shim is first. */
static void *shim(const char *name) { return dlsym(RTLD_DEFAULT, name); }

static long (*standin_calls)(const char *);
static long (*standin_runtime_calls)(int);

/* The stand-in driver and runtime, opened as XLA and cuda-python open the real ones. */
static void *cuda, *rt;

static int open_standins(void) {
  cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  rt = dlopen("libcudart.so.12", RTLD_NOW | RTLD_LOCAL);
  CHECK(cuda != NULL && rt != NULL);
  if (!cuda || !rt) return 0;
  *(void **)(&standin_calls) = dlsym(cuda, "standin_calls");
  *(void **)(&standin_runtime_calls) = dlsym(rt, "standin_runtime_calls");
  CHECK(standin_calls && standin_runtime_calls);
  return standin_calls && standin_runtime_calls;
}

/* Every way a program finds a stream destroy gives the shim's: dlsym in the driver's and the
 * runtime's handles, cuGetProcAddress (all three, every flag, the CUDA 2.0 function before
 * CUDA 4.0), cudaGetDriverEntryPoint and ...ByVersion (and their _ptsz twins). */
static void check_lookups(void) {
  void *v2 = shim("cuStreamDestroy_v2"), *legacy = shim("cuStreamDestroy"), *runtime = shim("cudaStreamDestroy");
  CHECK(v2 && legacy && runtime && v2 != legacy);
  CHECK(dlsym(cuda, "cuStreamDestroy_v2") == v2 && dlsym(cuda, "cuStreamDestroy") == legacy);
  CHECK(dlsym(rt, "cudaStreamDestroy") == runtime);
  CHECK(dlsym(rt, "cuStreamDestroy_v2") == v2); /* the driver, through the runtime that links it */
  void *get[3] = {dlsym(cuda, "cuGetProcAddress"), dlsym(cuda, "cuGetProcAddress_v2"),
                  dlsym(cuda, "cuGetProcAddress_v2_ptsz")};
  CHECK(get[0] && get[1] && get[2]);
  if (!get[0] || !get[1] || !get[2]) return;
  static const int versions[] = {3000, 3020, 4000, 11030, 12000, 12080, 13000};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    int v = versions[i];
    for (uint64_t flags = 0; flags <= 2; flags++) {
      for (int variant = 0; variant < 3; variant++) {
        void *fn = NULL;
        int status = -1;
        int r = variant == 0 ? CALL(get_proc_fn, get[0])("cuStreamDestroy", &fn, v, flags)
                             : CALL(get_proc_v2_fn, get[variant])("cuStreamDestroy", &fn, v, flags, &status);
        CHECK(r == 0 && fn == (v >= 4000 ? v2 : legacy));
      }
    }
  }
  void *entry = shim("cudaGetDriverEntryPoint"), *entry_ptsz = shim("cudaGetDriverEntryPoint_ptsz");
  void *by_version = shim("cudaGetDriverEntryPointByVersion");
  CHECK(entry && entry_ptsz && by_version);
  if (!entry || !entry_ptsz || !by_version) return;
  for (uint64_t flags = 0; flags <= 2; flags++) {
    void *fn = NULL, *fn_ptsz = NULL;
    CHECK(CALL(entry_fn, entry)("cuStreamDestroy", &fn, flags, NULL) == 0 && fn == v2);
    CHECK(CALL(entry_fn, entry_ptsz)("cuStreamDestroy", &fn_ptsz, flags, NULL) == 0 && fn_ptsz == v2);
  }
  void *fn = NULL;
  CHECK(CALL(entry_by_version_fn, by_version)("cuStreamDestroy", &fn, 12080, 0, NULL) == 0 && fn == v2);
  CHECK(CALL(entry_by_version_fn, by_version)("cuStreamDestroy", &fn, 3020, 0, NULL) == 0 && fn == legacy);
}

/* The destroys, each reaching the stand-in with its status unchanged. The exit report of this
 * child says which the shim retired first and which of those waited for the stream. */
static int report_child(void) {
  if (!open_standins()) return checks_report("test_preload_streams (report child)");
  void *destroy = dlsym(cuda, "cuStreamDestroy_v2"), *legacy = dlsym(cuda, "cuStreamDestroy");
  void *alloc_async = dlsym(cuda, "cuMemAllocAsync"), *free_async = dlsym(cuda, "cuMemFreeAsync");
  /* The stand-in runtime has no cudaMallocAsync: the shim's, as a program linking the runtime
   * binds it. */
  void *rt_destroy = dlsym(rt, "cudaStreamDestroy"), *rt_malloc_async = shim("cudaMallocAsync");
  void *rt_free_async = shim("cudaFreeAsync");
  CHECK(destroy && legacy && alloc_async && free_async && rt_destroy && rt_malloc_async && rt_free_async);
  if (!destroy || !legacy || !alloc_async || !free_async || !rt_destroy || !rt_malloc_async || !rt_free_async)
    return checks_report("test_preload_streams (report child)");
  /* A block freed on stream 0x10: the destroy waits for the stream (retired 1, waited 1). */
  uint64_t d = 0;
  CHECK(CALL(cu_alloc_async_fn, alloc_async)(&d, 4096, (void *)0x10) == 0 && d != 0);
  CHECK(CALL(cu_free_async_fn, free_async)(d, (void *)0x10) == 0);
  CHECK(CALL(destroy_fn, destroy)((void *)0x10) == 0);
  /* A stream gpupool never served: retired, no wait (2, 1). */
  CHECK(CALL(destroy_fn, destroy)((void *)0x20) == 0);
  /* The runtime's, on a stream of the runtime's cudaMallocAsync: retired and waited once (3, 2),
   * although the stand-in runtime destroys it through the shim's cuStreamDestroy_v2. */
  void *p = NULL;
  CHECK(CALL(malloc_async_fn, rt_malloc_async)(&p, 4096, (void *)0x30) == 0 && p != NULL);
  CHECK(CALL(free_async_fn, rt_free_async)(p, (void *)0x30) == 0);
  CHECK(CALL(destroy_fn, rt_destroy)((void *)0x30) == 0);
  /* The CUDA 2.0 function, and the driver's error (400) returned as it came (5, 2). */
  CHECK(CALL(destroy_fn, legacy)((void *)0xbad) == 400);
  CHECK(CALL(destroy_fn, destroy)((void *)0xbad) == 400);
  /* The default streams' handles: straight through, not retired. */
  CHECK(CALL(destroy_fn, destroy)(NULL) == 0 && CALL(destroy_fn, destroy)((void *)2) == 0);
  /* Every destroy reached the stand-ins: 0x10, 0x20, 0x30 (the runtime's), 0xbad, 0, 2. */
  CHECK(standin_calls("cuStreamDestroy_v2") == 6 && standin_calls("cuStreamDestroy") == 1);
  CHECK(standin_runtime_calls(3) == 1);
  return checks_report("test_preload_streams (report child)");
}

/* `test_preload_streams unstarted`: a destroy found with dlsym (which never starts gpupool)
 * before anything started gpupool goes straight to the driver and starts nothing, so there is
 * no exit report. */
static int unstarted_child(void) {
  if (!open_standins()) return checks_report("test_preload_streams (unstarted child)");
  void *destroy = dlsym(cuda, "cuStreamDestroy_v2");
  CHECK(destroy && destroy == shim("cuStreamDestroy_v2"));
  CHECK(destroy && CALL(destroy_fn, destroy)((void *)0x10) == 0 && standin_calls("cuStreamDestroy_v2") == 1);
  CHECK(destroy && CALL(destroy_fn, destroy)((void *)0xbad) == 400);
  return checks_report("test_preload_streams (unstarted child)");
}

int main(int argc, char **argv) {
  if (shim("gpupool_stats") == NULL || shim("cuStreamDestroy_v2") == NULL) {
    printf("test_preload_streams: skipped: libgpupool_preload.so is not preloaded\n");
    return 77;
  }
  if (argc > 1 && strcmp(argv[1], "report") == 0) return report_child();
  if (argc > 1 && strcmp(argv[1], "unstarted") == 0) return unstarted_child();
  if (!open_standins()) return checks_report("test_preload_streams");
  check_lookups();
  static char report[1 << 16];
  CHECK(child_report("test_preload_streams", report, sizeof report));
  int before = checks_failed;
  CHECK(strstr(report, "gpupool_preload: retired 5 streams before their destroy: waited for 2, 0 failed\n"));
  CHECK(strstr(report, "gpupool_preload: served 0 cudaMalloc, 1 cudaMallocAsync, 0 cuMemAlloc, 1 cuMemAllocAsync\n"));
  if (checks_failed != before) fprintf(stderr, "the report child's stderr:\n%s\n", report);
  before = checks_failed;
  CHECK(child_run("test_preload_streams", "unstarted", report, sizeof report));
  CHECK(strstr(report, "gpupool_preload:") == NULL);
  if (checks_failed != before) fprintf(stderr, "the unstarted child's stderr:\n%s\n", report);
  return checks_report("test_preload_streams");
}
