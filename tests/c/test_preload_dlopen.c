/* The LD_PRELOAD shim under a program that resolves the driver itself, as XLA does: it opens
 * a stand-in libcuda.so.1 (standin_libcuda.c) with dlopen, RTLD_LOCAL, and finds its entry
 * points with dlsym and cuGetProcAddress, and the runtime's through a stand-in libcudart.so.12
 * (standin_libcudart.c) and cudaGetDriverEntryPoint. The shim must hand out its own
 * allocation functions, served by gpupool on the simulated device, and pass every other
 * lookup and call through to the stand-ins, which count what reaches them. Run as
 *   LD_PRELOAD=libgpupool_preload.so GPUPOOL_DRIVER=sim LD_LIBRARY_PATH=<stand-ins> \
 *     ./test_preload_dlopen local|global
 * (the stand-in runtime opened RTLD_LOCAL or RTLD_GLOBAL).
 * Exit status 0 when every check passed; 77 (skipped) without the shim preloaded. It runs
 * itself once more, as `test_preload_dlopen report`, to read the shim's exit report. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
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

typedef int (*cu_alloc_fn)(uint64_t *, size_t);
typedef int (*cu_free_fn)(uint64_t);
typedef int (*cu_alloc_async_fn)(uint64_t *, size_t, void *);
typedef int (*cu_free_async_fn)(uint64_t, void *);
typedef int (*cu_count_fn)(int *);
typedef int (*cu_init_fn)(unsigned);
typedef int (*get_proc_fn)(const char *, void **, int, uint64_t);
typedef int (*get_proc_v2_fn)(const char *, void **, int, uint64_t, int *);
typedef int (*entry_fn)(const char *, void **, uint64_t, int *);
typedef int (*entry_by_version_fn)(const char *, void **, unsigned, uint64_t, int *);
typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef gpupool_status (*stats_fn)(int, gpupool_stats_t *);
typedef int (*mem_create_fn)(uint64_t *, size_t, const void *, unsigned long long);
typedef int (*mem_map_fn)(uint64_t, size_t, size_t, uint64_t, unsigned long long);
typedef int (*malloc_managed_fn)(void **, size_t, unsigned);

/* A function pointer held as dlsym's void *, called through its type (POSIX's way under
 * -Wpedantic). */
#define CALL(type, p) (*(type *)(&(p)))

static stats_fn get_stats;
static long (*standin_calls)(const char *);
static void *(*standin_internal)(const char *, int, uint64_t);

/* The shim's own definition of `name`: the global scope's, where the preloaded shim is first. */
static void *shim(const char *name) { return dlsym(RTLD_DEFAULT, name); }

/* Whether `fn` is code of the preloaded shim (a trampoline counting a passed-through call). */
static int in_shim(void *fn) {
  Dl_info a, b;
  memset(&a, 0, sizeof a);
  memset(&b, 0, sizeof b);
  return fn && dladdr(fn, &a) && dladdr(shim("cuMemAlloc_v2"), &b) && a.dli_fbase == b.dli_fbase;
}

static int64_t allocated(void) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK(get_stats(0, &s) == GPUPOOL_SUCCESS);
  return s.allocation.all.current;
}

/* The first lookups of the process, from 8 threads at once: each opens the driver, finds
 * cuMemAlloc_v2, cuMemFree_v2 and cuGetProcAddress_v2 and allocates and frees through them. */
#define RACERS 8
static pthread_barrier_t start_line;
struct racer {
  void *alloc, *free, *get_proc;
  int alloc_status, free_status;
};

static void *race(void *arg) {
  struct racer *r = arg;
  pthread_barrier_wait(&start_line);
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) return NULL;
  r->alloc = dlsym(h, "cuMemAlloc_v2");
  r->free = dlsym(h, "cuMemFree_v2");
  r->get_proc = dlsym(h, "cuGetProcAddress_v2");
  uint64_t d = 0;
  r->alloc_status = r->alloc ? CALL(cu_alloc_fn, r->alloc)(&d, 4096) : -1;
  r->free_status = r->free ? CALL(cu_free_fn, r->free)(d) : -1;
  dlclose(h);
  return NULL;
}

static void check_racing_first_lookups(void) {
  struct racer racers[RACERS];
  pthread_t threads[RACERS];
  memset(racers, 0, sizeof racers);
  pthread_barrier_init(&start_line, NULL, RACERS);
  for (int i = 0; i < RACERS; i++) CHECK(pthread_create(&threads[i], NULL, race, &racers[i]) == 0);
  for (int i = 0; i < RACERS; i++) pthread_join(threads[i], NULL);
  pthread_barrier_destroy(&start_line);
  for (int i = 0; i < RACERS; i++) {
    CHECK(racers[i].alloc != NULL && racers[i].alloc == shim("cuMemAlloc_v2"));
    CHECK(racers[i].free != NULL && racers[i].free == shim("cuMemFree_v2"));
    CHECK(racers[i].get_proc != NULL && racers[i].get_proc == shim("cuGetProcAddress_v2"));
    CHECK(racers[i].alloc_status == 0 && racers[i].free_status == 0);
  }
}

/* cuGetProcAddress (found with dlsym in the driver's handle) at every CUDA version from 11.3
 * to 13.0 and each flag: the shim's functions for the symbols it serves, the driver's for
 * the rest, the per-thread stream's allocation the driver's. */
static void check_get_proc_address(void *cuda) {
  void *v1 = dlsym(cuda, "cuGetProcAddress"), *v2 = dlsym(cuda, "cuGetProcAddress_v2");
  void *ptsz = dlsym(cuda, "cuGetProcAddress_v2_ptsz");
  CHECK(v1 == shim("cuGetProcAddress") && v2 == shim("cuGetProcAddress_v2") && ptsz == shim("cuGetProcAddress_v2_ptsz"));
  if (!v1 || !v2 || !ptsz) return;
  static const int versions[] = {11030, 11040, 11050, 11060, 11070, 11080, 12000, 12010, 12020, 12030,
                                 12040, 12050, 12060, 12080, 12090, 13000};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    int v = versions[i];
    for (uint64_t flags = 0; flags <= 2; flags++) {
      for (int variant = 0; variant < 3; variant++) {
        int per_thread = flags == 2 || (variant == 2 && flags == 0);
        void *v2_or_ptsz = variant == 1 ? v2 : ptsz;
        void *fn = NULL;
        int status = -1;
#define LOOK(name)                                                                              \
  (fn = NULL, variant == 0 ? CALL(get_proc_fn, v1)(name, &fn, v, flags)                         \
              : CALL(get_proc_v2_fn, v2_or_ptsz)(name, &fn, v, flags, &status))
        CHECK(LOOK("cuMemAlloc") == 0 && fn == shim("cuMemAlloc_v2"));
        CHECK(LOOK("cuMemFree") == 0 && fn == shim("cuMemFree_v2"));
        CHECK(LOOK("cuMemAllocAsync") == 0 &&
              fn == (per_thread ? standin_internal("cuMemAllocAsync", v, 2) : shim("cuMemAllocAsync")));
        CHECK(LOOK("cuMemFreeAsync") == 0 && fn == shim(per_thread ? "cuMemFreeAsync_ptsz" : "cuMemFreeAsync"));
        CHECK(LOOK("cuGetProcAddress") == 0 &&
              fn == shim(v < 12000 ? "cuGetProcAddress" : per_thread ? "cuGetProcAddress_v2_ptsz" : "cuGetProcAddress_v2"));
        CHECK(LOOK("cuDeviceGetCount") == 0 && fn != NULL && fn == standin_internal("cuDeviceGetCount", v, 0));
        /* Not served, a memory function: the driver's behind the shim's counting trampoline. */
        CHECK(LOOK("cuMemCreate") == 0 && in_shim(fn) && fn != standin_internal("cuMemCreate", v, 0));
        if (variant > 0) CHECK(status == 0);
        CHECK(LOOK("cuNoSuchFunction") == 500 && fn == NULL);
        CHECK(LOOK("") == 500 && fn == NULL);
        if (variant > 0) CHECK(status == 1); /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, the driver's */
#undef LOOK
      }
    }
  }
  /* Before CUDA 3.2 "cuMemAlloc" meant the 32-bit function: not the shim's (this driver has none). */
  void *fn = NULL;
  CHECK(CALL(get_proc_fn, v1)("cuMemAlloc", &fn, 3000, 0) == 500 && fn == NULL);
  /* The driver's answer to NULL arguments, unchanged. */
  CHECK(CALL(get_proc_v2_fn, v2)(NULL, &fn, 12000, 0, NULL) == 1);
  CHECK(CALL(get_proc_v2_fn, v2)("cuMemAlloc", NULL, 12000, 0, NULL) == 1);
  /* A pointer the shim got from cuGetProcAddress allocates from gpupool. */
  CHECK(CALL(get_proc_v2_fn, v2)("cuMemAlloc", &fn, 12000, 0, NULL) == 0);
  uint64_t d = 0;
  int64_t before = allocated();
  CHECK(fn && CALL(cu_alloc_fn, fn)(&d, 1000) == 0 && d != 0);
  CHECK(allocated() == before + 1);
  void *dfree = shim("cuMemFree_v2");
  CHECK(CALL(cu_free_fn, dfree)(d) == 0);
}

/* cudaGetDriverEntryPoint and ...ByVersion, and their _ptsz twins, of the stand-in runtime:
 * the shim's functions for what it serves, the driver's otherwise. The runtime is opened
 * RTLD_GLOBAL (`global`: as a program linked with it has it), or RTLD_LOCAL, as Python opens
 * an extension module and the runtime it links: out of RTLD_NEXT's reach, yet the shim must
 * find it. */
static void check_runtime_entry_points(int global) {
  void *rt = dlopen("libcudart.so.12", RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
  CHECK(rt != NULL);
  void *entry = shim("cudaGetDriverEntryPoint"), *entry_ptsz = shim("cudaGetDriverEntryPoint_ptsz");
  void *by_version = shim("cudaGetDriverEntryPointByVersion");
  void *by_version_ptsz = shim("cudaGetDriverEntryPointByVersion_ptsz");
  CHECK(entry && entry_ptsz && by_version && by_version_ptsz);
  if (!rt || !entry || !entry_ptsz || !by_version || !by_version_ptsz) return;
  void *fn = NULL;
  int status = -1;
  CHECK(CALL(entry_fn, entry)("cuMemAlloc", &fn, 0, &status) == 0 && fn == shim("cuMemAlloc_v2") && status == 0);
  CHECK(CALL(entry_fn, entry)("cuMemAllocAsync", &fn, 0, NULL) == 0 && fn == shim("cuMemAllocAsync"));
  CHECK(CALL(entry_fn, entry)("cuMemAllocAsync", &fn, 2, NULL) == 0 &&
        fn == standin_internal("cuMemAllocAsync", 12080, 2));
  CHECK(CALL(entry_fn, entry_ptsz)("cuMemAllocAsync", &fn, 0, NULL) == 0 &&
        fn == standin_internal("cuMemAllocAsync", 12080, 2));
  CHECK(CALL(entry_fn, entry_ptsz)("cuMemAllocAsync", &fn, 1, NULL) == 0 && fn == shim("cuMemAllocAsync"));
  CHECK(CALL(entry_fn, entry_ptsz)("cuMemFreeAsync", &fn, 0, NULL) == 0 && fn == shim("cuMemFreeAsync_ptsz"));
  CHECK(CALL(entry_fn, entry)("cuGetProcAddress", &fn, 0, NULL) == 0 && fn == shim("cuGetProcAddress_v2"));
  CHECK(CALL(entry_fn, entry)("cuDeviceGetCount", &fn, 0, NULL) == 0 &&
        fn == standin_internal("cuDeviceGetCount", 12080, 0));
  CHECK(CALL(entry_fn, entry)("cuNoSuchFunction", &fn, 0, &status) == 500 && fn == NULL && status == 1);
  /* dlsym in the runtime's handle, as XLA's and cuda-python's loaders resolve it: the shim's
   * functions where it serves them, the runtime's otherwise, missing where the runtime lacks
   * them. */
  CHECK(dlsym(rt, "cudaGetDriverEntryPoint") == entry);
  /* The driver, a dependency of the runtime, through the runtime's handle: the shim's too. */
  CHECK(dlsym(rt, "cuMemAlloc_v2") == shim("cuMemAlloc_v2"));
  CHECK(dlsym(rt, "cudaGetDriverEntryPointByVersion_ptsz") == by_version_ptsz);
  void *rt_malloc = dlsym(rt, "cudaMalloc"), *rt_free = dlsym(rt, "cudaFree");
  void *rt_version = dlsym(rt, "cudaRuntimeGetVersion");
  long (*rt_calls)(int) = NULL;
  *(void **)(&rt_calls) = dlsym(rt, "standin_runtime_calls");
  CHECK(rt_malloc != NULL && rt_malloc == shim("cudaMalloc") && rt_free == shim("cudaFree"));
  int version = 0;
  CHECK(rt_version && CALL(cu_count_fn, rt_version)(&version) == 0 && version == 12080);
  dlerror();
  CHECK(dlsym(rt, "cudaMallocHost") == NULL && dlerror() != NULL);
  /* A runtime memory function the shim does not serve: counted on its way to the runtime. */
  void *managed = dlsym(rt, "cudaMallocManaged");
  CHECK(in_shim(managed) && !in_shim(shim("cudaMallocManaged")));
  if (managed && rt_calls) {
    void *m = NULL;
    CHECK(CALL(malloc_managed_fn, managed)(&m, 64, 1) == 2 && rt_calls(2) == 1);
  }
  if (rt_malloc && rt_free && rt_calls) {
    int64_t before = allocated();
    void *p = NULL;
    CHECK(CALL(malloc_fn, rt_malloc)(&p, 4096) == 0 && allocated() == before + 1);
    CHECK(CALL(free_fn, rt_free)(p) == 0 && allocated() == before);
    /* A pointer that is not gpupool's: the runtime's cudaFree, found however it was opened. */
    CHECK(CALL(free_fn, rt_free)((void *)0x1234) == 1);
    CHECK(rt_calls(0) == 0 && rt_calls(1) == 1);
  }
  for (unsigned v = 11030; v <= 13000; v += 10) {
    CHECK(CALL(entry_by_version_fn, by_version)("cuMemFree", &fn, v, 0, NULL) == 0 && fn == shim("cuMemFree_v2"));
    CHECK(CALL(entry_by_version_fn, by_version)("cuGetProcAddress", &fn, v, 0, NULL) == 0 &&
          fn == shim(v >= 12000 ? "cuGetProcAddress_v2" : "cuGetProcAddress"));
    CHECK(CALL(entry_by_version_fn, by_version_ptsz)("cuMemAllocAsync", &fn, v, 0, NULL) == 0 &&
          fn == standin_internal("cuMemAllocAsync", (int)v, 2));
  }
}

/* Memory allocated through one API and freed through another: gpupool's whichever way. */
static void check_mixed_apis(void *cuda) {
  void *alloc = dlsym(cuda, "cuMemAlloc_v2"), *dfree = dlsym(cuda, "cuMemFree_v2");
  void *alloc_async = dlsym(cuda, "cuMemAllocAsync"), *free_async = dlsym(cuda, "cuMemFreeAsync");
  void *free_async_ptsz = dlsym(cuda, "cuMemFreeAsync_ptsz");
  void *cuda_malloc = shim("cudaMalloc"), *cuda_free = shim("cudaFree");
  CHECK(alloc && dfree && alloc_async && free_async && free_async_ptsz && cuda_malloc && cuda_free);
  if (!alloc || !dfree || !alloc_async || !free_async || !free_async_ptsz || !cuda_malloc || !cuda_free) return;
  int64_t before = allocated();
  uint64_t d = 0;
  void *p = NULL;
  /* dlsym'd cuMemAlloc, freed by the runtime's cudaFree. */
  CHECK(CALL(cu_alloc_fn, alloc)(&d, 4096) == 0 && allocated() == before + 1);
  CHECK(CALL(free_fn, cuda_free)((void *)(uintptr_t)d) == 0 && allocated() == before);
  /* cudaMalloc, freed by dlsym'd cuMemFree and (refused: freed already) again. */
  CHECK(CALL(malloc_fn, cuda_malloc)(&p, 4096) == 0 && allocated() == before + 1);
  CHECK(CALL(cu_free_fn, dfree)((uint64_t)(uintptr_t)p) == 0 && allocated() == before);
  CHECK(CALL(cu_free_fn, dfree)((uint64_t)(uintptr_t)p) == 1);
  /* Stream-ordered allocation freed by cuMemFree; cuMemAlloc freed in a stream's order, and
   * through the per-thread stream's cuMemFreeAsync_ptsz. */
  CHECK(CALL(cu_alloc_async_fn, alloc_async)(&d, 8192, (void *)0x10) == 0);
  CHECK(CALL(cu_free_fn, dfree)(d) == 0 && allocated() == before);
  CHECK(CALL(cu_alloc_fn, alloc)(&d, 8192) == 0);
  CHECK(CALL(cu_free_async_fn, free_async)(d, (void *)0x20) == 0 && allocated() == before);
  CHECK(CALL(cu_alloc_fn, alloc)(&d, 8192) == 0);
  CHECK(CALL(cu_free_async_fn, free_async_ptsz)(d, NULL) == 0 && allocated() == before);
  CHECK(CALL(cu_alloc_fn, alloc)(&d, 8192) == 0);
  CHECK(CALL(cu_free_async_fn, free_async_ptsz)(d, (void *)0x30) == 0 && allocated() == before);
  /* None of it reached the driver, which has no memory. */
  CHECK(standin_calls("cuMemAlloc_v2") == 0 && standin_calls("cuMemAllocAsync") == 0);
}

/* Lookups the shim leaves alone, and calls it passes through to the driver. */
static void check_pass_through(void *cuda) {
  /* Symbols the shim does not serve are the driver's. */
  void *init = dlsym(cuda, "cuInit"), *count = dlsym(cuda, "cuDeviceGetCount");
  CHECK(init != NULL && shim("cuInit") == NULL);
  CHECK(init && CALL(cu_init_fn, init)(0) == 0 && standin_calls("cuInit") == 1);
  int n = 0;
  CHECK(count && CALL(cu_count_fn, count)(&n) == 0 && n == 1);
  void *alloc_ptsz = dlsym(cuda, "cuMemAllocAsync_ptsz");
  uint64_t d = 0;
  CHECK(alloc_ptsz && CALL(cu_alloc_async_fn, alloc_ptsz)(&d, 64, NULL) == 2);
  CHECK(standin_calls("cuMemAllocAsync_ptsz") == 1);
  /* Memory functions the shim does not serve: the driver's, behind a trampoline of the shim
   * that counts the calls for the exit report; every argument reaches the driver and its
   * status comes back. Looked up again: the same trampoline. */
  void *create = dlsym(cuda, "cuMemCreate"), *map = dlsym(cuda, "cuMemMap");
  /* (The shim's own cuMemCreate, which counts calls made by name, vmm.rs, is another function:
   * a lookup gets the trampoline, as for every memory function it does not serve.) */
  CHECK(in_shim(create) && in_shim(map) && create != map && create != shim("cuMemCreate"));
  CHECK(dlsym(cuda, "cuMemCreate") == create);
  if (create && map) {
    uint64_t h = 0;
    CHECK(CALL(mem_create_fn, create)(&h, 4096, NULL, 0) == 2 && standin_calls("cuMemCreate") == 1);
    CHECK(CALL(mem_map_fn, map)(1, 2, 3, 4, 5) == 0 && CALL(mem_map_fn, map)(1, 2, 3, 4, 6) == 1);
    CHECK(standin_calls("cuMemMap") == 2);
  }
  /* A symbol the shim serves but the driver lacks stays missing, with dlerror's message. */
  dlerror();
  CHECK(dlsym(cuda, "cuMemHostAlloc") == NULL && dlerror() != NULL);
  CHECK(shim("cuMemHostAlloc") != NULL);
  /* Frees of pointers that are not gpupool's reach the driver, whichever way found. */
  long frees = standin_calls("cuMemFree_v2");
  void *dfree = dlsym(cuda, "cuMemFree_v2"), *free_ptsz = dlsym(cuda, "cuMemFreeAsync_ptsz");
  CHECK(dfree && CALL(cu_free_fn, dfree)(0x1234) == 1);
  CHECK(dfree && CALL(cu_free_fn, dfree)(0) == 1);
  CHECK(standin_calls("cuMemFree_v2") == frees + 2);
  CHECK(free_ptsz && CALL(cu_free_async_fn, free_ptsz)(0x1234, NULL) == 1);
  CHECK(standin_calls("cuMemFreeAsync_ptsz") == 1);
  /* Names that are nothing: as glibc answers them. */
  static char longname[8192];
  memset(longname, 'c', sizeof longname - 1);
  longname[1] = 'u';
  const char *garbage[] = {"", "c", "cu", "cuMemAlloc_v2 ", "cuMemAlloc_v3", "CUMEMALLOC_V2", longname};
  for (size_t i = 0; i < sizeof garbage / sizeof garbage[0]; i++) {
    dlerror();
    CHECK(dlsym(cuda, garbage[i]) == NULL && dlerror() != NULL);
  }
  /* Other handles: the program's own (the global scope, the shim's definition first), another
   * library's (no such symbol); RTLD_NEXT from the program is the object after the program:
   * the preloaded shim, whose cudaMalloc and dlsym come next. */
  void *self = dlopen(NULL, RTLD_NOW);
  CHECK(self && dlsym(self, "cuMemAlloc_v2") == shim("cuMemAlloc_v2"));
  void *libm = dlopen("libm.so.6", RTLD_NOW | RTLD_LOCAL);
  dlerror();
  CHECK(libm && dlsym(libm, "cuMemAlloc_v2") == NULL && dlerror() != NULL);
  CHECK(libm && dlsym(libm, "cos") != NULL);
  CHECK(dlsym(RTLD_NEXT, "cudaMalloc") != NULL && dlsym(RTLD_NEXT, "cudaMalloc") == shim("cudaMalloc"));
  CHECK(dlsym(RTLD_NEXT, "dlsym") == shim("dlsym"));
  CHECK(dlsym(RTLD_NEXT, "cuMemAlloc_v2") == shim("cuMemAlloc_v2"));
  if (libm) dlclose(libm);
  if (self) dlclose(self);
}

/* The driver closed and opened again, by other names: the shim still answers for it. */
static void check_reopen(void *cuda) {
  Dl_info info;
  memset(&info, 0, sizeof info);
  CHECK(dladdr(dlsym(cuda, "cuInit"), &info) != 0 && info.dli_fname != NULL);
  char path[4096];
  snprintf(path, sizeof path, "%s", info.dli_fname ? info.dli_fname : "");
  void *init = dlsym(cuda, "cuInit");
  CHECK(dlclose(cuda) == 0);
  const char *names[] = {path, "libcuda.so", "libcuda.so.1"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    CHECK(h != NULL);
    if (!h) continue;
    CHECK(dlsym(h, "cuMemAlloc_v2") == shim("cuMemAlloc_v2"));
    CHECK(dlsym(h, "cuInit") != NULL && dlsym(h, "cuInit") == init);
    CHECK(dlclose(h) == 0);
  }
}

/* `test_preload_dlopen report`, under GPUPOOL_PRELOAD_STATS=on: 4 lookups served (3 dlsym,
 * 1 cuGetProcAddress), 4 passed through (cuInit, cuDeviceGetCount, cuMemCreate, cuMemMap),
 * 1 cuMemAlloc served, and the calls that went to cuMemCreate (3) and cuMemMap (2). */
static int report_child(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  CHECK(cuda != NULL);
  if (!cuda) return 1;
  void *alloc = dlsym(cuda, "cuMemAlloc_v2"), *dfree = dlsym(cuda, "cuMemFree_v2");
  void *v2 = dlsym(cuda, "cuGetProcAddress_v2"), *init = dlsym(cuda, "cuInit");
  void *fn = NULL;
  CHECK(alloc && dfree && v2 && init);
  if (!alloc || !dfree || !v2 || !init) return 1;
  CHECK(CALL(get_proc_v2_fn, v2)("cuMemAlloc", &fn, 12000, 0, NULL) == 0 && fn == alloc);
  CHECK(CALL(get_proc_v2_fn, v2)("cuDeviceGetCount", &fn, 12000, 0, NULL) == 0);
  uint64_t d = 0;
  CHECK(CALL(cu_alloc_fn, alloc)(&d, 4096) == 0);
  CHECK(CALL(cu_free_fn, dfree)(d) == 0);
  void *create = dlsym(cuda, "cuMemCreate"), *map = NULL;
  CHECK(CALL(get_proc_v2_fn, v2)("cuMemMap", &map, 12000, 0, NULL) == 0);
  CHECK(create && map);
  if (!create || !map) return 1;
  for (int i = 0; i < 3; i++) CHECK(CALL(mem_create_fn, create)(&d, 4096, NULL, 0) == 2);
  for (int i = 0; i < 2; i++) CHECK(CALL(mem_map_fn, map)(1, 2, 3, 4, 5) == 0);
  return checks_report("test_preload_dlopen (exit report child)");
}

static void check_exit_report(void) {
  static char report[1 << 16];
  CHECK(child_report("test_preload_dlopen", report, sizeof report));
  int before = checks_failed;
  CHECK(strstr(report, "gpupool_preload: served 0 cudaMalloc, 0 cudaMallocAsync, 1 cuMemAlloc, 0 cuMemAllocAsync\n"));
  CHECK(strstr(report, "gpupool_preload: CUDA lookups: served 4, passed through 4\n"));
  CHECK(strstr(report, "gpupool_preload: passed through 3 calls to cuMemCreate (not served)\n"
                       "gpupool_preload: passed through 2 calls to cuMemMap (not served)\n"));
  if (checks_failed != before) fprintf(stderr, "the child's stderr:\n%s\n", report);
}

int main(int argc, char **argv) {
  *(void **)(&get_stats) = shim("gpupool_stats");
  if (get_stats == NULL || shim("cuMemAlloc_v2") == NULL) {
    printf("test_preload_dlopen: skipped: libgpupool_preload.so is not preloaded\n");
    return 77;
  }
  if (argc > 1 && strcmp(argv[1], "report") == 0) return report_child();
  check_racing_first_lookups();
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  CHECK(cuda != NULL);
  if (cuda == NULL) return checks_report("test_preload_dlopen");
  *(void **)(&standin_calls) = dlsym(cuda, "standin_calls");
  *(void **)(&standin_internal) = dlsym(cuda, "standin_internal");
  CHECK(standin_calls && standin_internal);
  if (!standin_calls || !standin_internal) return checks_report("test_preload_dlopen");
  /* Each served symbol found in the driver's handle is the shim's. */
  const char *served[] = {"cuMemAlloc_v2",       "cuMemFree_v2",     "cuMemAllocAsync",
                          "cuMemFreeAsync",      "cuMemFreeAsync_ptsz", "cuGetProcAddress",
                          "cuGetProcAddress_v2", "cuGetProcAddress_v2_ptsz"};
  for (size_t i = 0; i < sizeof served / sizeof served[0]; i++)
    CHECK(shim(served[i]) != NULL && dlsym(cuda, served[i]) == shim(served[i]));
  check_mixed_apis(cuda);
  check_pass_through(cuda);
  check_get_proc_address(cuda);
  check_runtime_entry_points(argc > 1 && strcmp(argv[1], "global") == 0);
  check_reopen(cuda);
  check_exit_report();
  return checks_report("test_preload_dlopen");
}
