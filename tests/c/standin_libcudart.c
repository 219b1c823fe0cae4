/* A stand-in CUDA runtime, libcudart.so.12, for test_preload_dlopen and test_preload_streams:
 * the runtime's way to the driver's functions (cudaGetDriverEntryPoint,
 * cudaGetDriverEntryPointByVersion and their _ptsz twins), cudaRuntimeGetVersion, a cudaMalloc
 * and cudaFree that count their calls and have no memory, and a cudaStreamDestroy that counts
 * its calls and destroys through the driver, as the real one does. As the real runtime asks
 * the driver, the lookups give the stand-in driver's internal functions (standin_libcuda.c's
 * standin_internal), never the shim's: the shim must put its own in their place. Unlike the
 * real runtime it links the driver (DT_NEEDED), so that the test can look the driver up
 * through a handle of a library that links it. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))
#define RUNTIME_VERSION 12080

/* standin_libcuda.c's window into the driver's internal functions (linked: DT_NEEDED). */
void *standin_internal(const char *symbol, int version, uint64_t flags);

/* cudaError_t: 0 success, 1 cudaErrorInvalidValue, 500 cudaErrorSymbolNotFound. */
static int lookup(const char *symbol, void **fn, int version, uint64_t flags, int *status) {
  if (symbol == NULL || fn == NULL) return 1;
  *fn = standin_internal(symbol, version, flags);
  if (status) *status = *fn ? 0 : 1; /* cudaDriverEntryPointSuccess, ...SymbolNotFound */
  return *fn ? 0 : 500;
}

EXPORT int cudaRuntimeGetVersion(int *v) {
  *v = RUNTIME_VERSION;
  return 0;
}
EXPORT int cudaGetDriverEntryPoint(const char *symbol, void **fn, uint64_t flags, int *status) {
  return lookup(symbol, fn, RUNTIME_VERSION, flags, status);
}
/* cudaEnableDefault (0) means the per-thread default stream here: cudaEnablePerThreadDefaultStream. */
EXPORT int cudaGetDriverEntryPoint_ptsz(const char *symbol, void **fn, uint64_t flags, int *status) {
  return lookup(symbol, fn, RUNTIME_VERSION, flags & 1 ? flags : flags | 2, status);
}
EXPORT int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned version, uint64_t flags,
                                            int *status) {
  return lookup(symbol, fn, (int)version, flags, status);
}
EXPORT int cudaGetDriverEntryPointByVersion_ptsz(const char *symbol, void **fn, unsigned version, uint64_t flags,
                                                 int *status) {
  return lookup(symbol, fn, (int)version, flags & 1 ? flags : flags | 2, status);
}

static unsigned long mallocs, frees, managed, stream_destroys;
/* cudaErrorMemoryAllocation: this runtime has no memory. */
EXPORT int cudaMalloc(void **p, size_t n) {
  (void)p;
  (void)n;
  __atomic_fetch_add(&mallocs, 1, __ATOMIC_RELAXED);
  return 2;
}
/* cudaErrorInvalidValue: no pointer is this runtime's. */
EXPORT int cudaFree(void *p) {
  (void)p;
  __atomic_fetch_add(&frees, 1, __ATOMIC_RELAXED);
  return 1;
}
/* Not served by the shim: reaches this runtime through a trampoline counting its calls. */
EXPORT int cudaMallocManaged(void **p, size_t n, unsigned flags) {
  (void)p;
  (void)n;
  (void)flags;
  __atomic_fetch_add(&managed, 1, __ATOMIC_RELAXED);
  return 2;
}
/* As the real runtime destroys a stream: through the driver's cuStreamDestroy_v2, which it
 * found as it finds every driver function, with cuGetProcAddress from its dlsym in its own
 * handle of libcuda.so.1. Under the shim both lookups answer with the shim's functions, so the
 * shim's cudaStreamDestroy calls its own cuStreamDestroy_v2 through here. */
EXPORT int cudaStreamDestroy(void *stream) {
  __atomic_fetch_add(&stream_destroys, 1, __ATOMIC_RELAXED);
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  int (*get_proc)(const char *, void **, int, uint64_t, int *) = NULL;
  int (*destroy)(void *) = NULL;
  if (cuda) *(void **)(&get_proc) = dlsym(cuda, "cuGetProcAddress_v2");
  int r = get_proc ? get_proc("cuStreamDestroy", (void **)&destroy, RUNTIME_VERSION, 0, NULL) : 1;
  r = r == 0 && destroy ? destroy(stream) : 1;
  if (cuda) dlclose(cuda);
  return r; /* 400: cudaErrorInvalidResourceHandle, as the driver's CUDA_ERROR_INVALID_HANDLE */
}

/* The test's window: calls that reached cudaMalloc (`which` 0), cudaFree (1),
 * cudaMallocManaged (2) or cudaStreamDestroy (3). */
EXPORT long standin_runtime_calls(int which) {
  unsigned long *counts[] = {&mallocs, &frees, &managed, &stream_destroys};
  return which >= 0 && which < 4 ? (long)__atomic_load_n(counts[which], __ATOMIC_RELAXED) : -1;
}
