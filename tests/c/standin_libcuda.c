/* A stand-in CUDA driver, libcuda.so.1, for test_preload_dlopen and test_preload_streams: the
 * entry points a runtime resolves itself (XLA: dlopen, dlsym, cuGetProcAddress) and the stream
 * destroys, each counting its calls, none of them able to allocate. The shim
 * (LD_PRELOAD=libgpupool_preload.so, GPUPOOL_DRIVER=sim) must answer the allocation functions
 * from gpupool's simulated device, so an allocation that reaches this library is a failure the
 * test sees (CUDA_ERROR_OUT_OF_MEMORY, and a count).
 *
 * As in the real driver, cuGetProcAddress hands out the library's internal functions, not its
 * exported symbols (which the dynamic linker would bind to the shim's, preloaded first): a
 * lookup that reaches this library unchanged gives functions that are not the shim's. */
#include <stdint.h>
#include <string.h>

enum { F_INIT, F_ALLOC, F_FREE, F_ALLOC_ASYNC, F_FREE_ASYNC, F_ALLOC_ASYNC_PTSZ, F_FREE_ASYNC_PTSZ,
       F_DEVICE_COUNT, F_GET_PROC, F_MEM_CREATE, F_MEM_MAP, F_STREAM_DESTROY, F_STREAM_DESTROY_LEGACY,
       F_COUNT };
static const char *const names[F_COUNT] = {
    "cuInit", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemAllocAsync", "cuMemFreeAsync",
    "cuMemAllocAsync_ptsz", "cuMemFreeAsync_ptsz", "cuDeviceGetCount", "cuGetProcAddress", "cuMemCreate",
    "cuMemMap", "cuStreamDestroy_v2", "cuStreamDestroy"};
static unsigned long calls[F_COUNT];

static void count(int f) { __atomic_fetch_add(&calls[f], 1, __ATOMIC_RELAXED); }

/* CUDA_ERROR_OUT_OF_MEMORY: this driver has no memory. */
static int init(unsigned flags) { (void)flags; count(F_INIT); return 0; }
static int alloc(uint64_t *p, size_t n) { (void)p; (void)n; count(F_ALLOC); return 2; }
/* CUDA_ERROR_INVALID_VALUE: no pointer is this driver's. */
static int release(uint64_t p) { (void)p; count(F_FREE); return 1; }
static int alloc_async(uint64_t *p, size_t n, void *s) { (void)p; (void)n; (void)s; count(F_ALLOC_ASYNC); return 2; }
static int free_async(uint64_t p, void *s) { (void)p; (void)s; count(F_FREE_ASYNC); return 1; }
static int alloc_async_ptsz(uint64_t *p, size_t n, void *s) { (void)p; (void)n; (void)s; count(F_ALLOC_ASYNC_PTSZ); return 2; }
static int free_async_ptsz(uint64_t p, void *s) { (void)p; (void)s; count(F_FREE_ASYNC_PTSZ); return 1; }
static int device_count(int *n) { count(F_DEVICE_COUNT); *n = 1; return 0; }
/* Virtual memory management, which the shim does not serve (XLA's way to allocate): no
 * memory to create; a mapping succeeds when its arguments are 1, 2, 3, 4, 5, so that the
 * test sees each argument arrive through the shim's counting trampoline. */
static int mem_create(uint64_t *h, size_t n, const void *prop, unsigned long long flags) {
  (void)h; (void)n; (void)prop; (void)flags; count(F_MEM_CREATE); return 2;
}
static int mem_map(uint64_t p, size_t n, size_t offset, uint64_t h, unsigned long long flags) {
  count(F_MEM_MAP);
  return p == 1 && n == 2 && offset == 3 && h == 4 && flags == 5 ? 0 : 1;
}

/* A stream destroyed: CUDA_ERROR_INVALID_HANDLE (400) for the handle 0xbad, so that the test
 * sees the status come back unchanged through the shim; else success. */
static int stream_destroy(void *s) {
  count(F_STREAM_DESTROY);
  return s == (void *)0xbad ? 400 : 0;
}
static int stream_destroy_legacy(void *s) {
  count(F_STREAM_DESTROY_LEGACY);
  return s == (void *)0xbad ? 400 : 0;
}

/* The internal function for a base name at cudaVersion with flags, as cuGetProcAddress sees it:
 * CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (2) gives the _ptsz variants. */
static void *internal(const char *symbol, int version, uint64_t flags);

static int get_proc(const char *symbol, void **pfn, int version, uint64_t flags) {
  count(F_GET_PROC);
  if (symbol == NULL || pfn == NULL) return 1;
  *pfn = internal(symbol, version, flags);
  return *pfn ? 0 : 500; /* CUDA_ERROR_NOT_FOUND */
}
static int get_proc_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  int r = get_proc(symbol, pfn, version, flags);
  if (status) *status = r == 0 ? 0 : 1; /* CU_GET_PROC_ADDRESS_SUCCESS, _SYMBOL_NOT_FOUND */
  return r;
}
static int get_proc_v2_ptsz(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  return get_proc_v2(symbol, pfn, version, flags & 1 ? flags : flags | 2, status);
}

static void *internal(const char *symbol, int version, uint64_t flags) {
  int ptds = (flags & 2) != 0;
  if (!strcmp(symbol, "cuInit")) return (void *)init;
  if (!strcmp(symbol, "cuMemAlloc") && version >= 3020) return (void *)alloc;
  if (!strcmp(symbol, "cuMemFree") && version >= 3020) return (void *)release;
  if (!strcmp(symbol, "cuMemAllocAsync")) return ptds ? (void *)alloc_async_ptsz : (void *)alloc_async;
  if (!strcmp(symbol, "cuMemFreeAsync")) return ptds ? (void *)free_async_ptsz : (void *)free_async;
  if (!strcmp(symbol, "cuDeviceGetCount")) return (void *)device_count;
  if (!strcmp(symbol, "cuMemCreate")) return (void *)mem_create;
  if (!strcmp(symbol, "cuMemMap")) return (void *)mem_map;
  /* cuda.h: #define cuStreamDestroy cuStreamDestroy_v2, from CUDA 4.0 */
  if (!strcmp(symbol, "cuStreamDestroy"))
    return version >= 4000 ? (void *)stream_destroy : (void *)stream_destroy_legacy;
  if (!strcmp(symbol, "cuGetProcAddress")) return version >= 12000 ? (void *)get_proc_v2 : (void *)get_proc;
  return NULL;
}

/* The exported entry points, as -lcuda and dlsym find them. */
#define EXPORT __attribute__((visibility("default")))
EXPORT int cuInit(unsigned flags) { return init(flags); }
EXPORT int cuMemAlloc_v2(uint64_t *p, size_t n) { return alloc(p, n); }
EXPORT int cuMemFree_v2(uint64_t p) { return release(p); }
EXPORT int cuMemAllocAsync(uint64_t *p, size_t n, void *s) { return alloc_async(p, n, s); }
EXPORT int cuMemFreeAsync(uint64_t p, void *s) { return free_async(p, s); }
EXPORT int cuMemAllocAsync_ptsz(uint64_t *p, size_t n, void *s) { return alloc_async_ptsz(p, n, s); }
EXPORT int cuMemFreeAsync_ptsz(uint64_t p, void *s) { return free_async_ptsz(p, s); }
EXPORT int cuDeviceGetCount(int *n) { return device_count(n); }
EXPORT int cuMemCreate(uint64_t *h, size_t n, const void *prop, unsigned long long flags) {
  return mem_create(h, n, prop, flags);
}
EXPORT int cuMemMap(uint64_t p, size_t n, size_t offset, uint64_t h, unsigned long long flags) {
  return mem_map(p, n, offset, h, flags);
}
EXPORT int cuStreamDestroy_v2(void *s) { return stream_destroy(s); }
EXPORT int cuStreamDestroy(void *s) { return stream_destroy_legacy(s); }
EXPORT int cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
  return get_proc(symbol, pfn, version, flags);
}
EXPORT int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  return get_proc_v2(symbol, pfn, version, flags, status);
}
EXPORT int cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  return get_proc_v2_ptsz(symbol, pfn, version, flags, status);
}

/* The test's window into this library: how many calls reached the function `name` (its
 * exported name; cuGetProcAddress counts every variant), or -1 for a name it does not have.
 * Not a CUDA name, so the shim's dlsym never looks at it. */
EXPORT long standin_calls(const char *name) {
  for (int f = 0; f < F_COUNT; f++)
    if (!strcmp(name, names[f])) return (long)__atomic_load_n(&calls[f], __ATOMIC_RELAXED);
  return -1;
}

/* The internal function cuGetProcAddress gives for `symbol`, so that the test can tell the
 * driver's answer from the shim's. */
EXPORT void *standin_internal(const char *symbol, int version, uint64_t flags) {
  return internal(symbol, version, flags);
}
