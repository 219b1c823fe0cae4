/* dlopen_app: a program that opens the CUDA driver itself, as XLA does, for the LD_PRELOAD
 * tests: dlopen("libcuda.so.1", RTLD_LOCAL), every entry point found with dlsym, and
 * cuMemAlloc/cuMemFree also through cuGetProcAddress (CUDA 12's, CUDA 11's where the driver
 * still has it, and the one cuGetProcAddress gives for itself). Needs no CUDA headers. Every
 * buffer round-trips data, checked, and is freed through another lookup than its allocation.
 * Prints "dlopen_app: ok, N cuMemAlloc" (N: the allocations made in the primary context,
 * which the shim must all serve) and exits 0 when every check passed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*init_fn)(unsigned);
typedef int (*device_get_fn)(int *, int);
typedef int (*retain_fn)(void **, int);
typedef int (*release_fn)(int);
typedef int (*set_current_fn)(void *);
typedef int (*alloc_fn)(uint64_t *, size_t);
typedef int (*free_fn)(uint64_t);
typedef int (*htod_fn)(uint64_t, const void *, size_t);
typedef int (*dtoh_fn)(void *, uint64_t, size_t);
typedef int (*get_proc_fn)(const char *, void **, int, uint64_t);
typedef int (*get_proc_v2_fn)(const char *, void **, int, uint64_t, int *);

static void *driver;

/* dlsym in the driver's handle, as a function pointer of the caller's type (through memcpy:
 * ISO C has no cast from void * to a function pointer). */
static void *need(const char *name) {
  void *p = dlsym(driver, name);
  if (p == NULL) {
    fprintf(stderr, "dlopen_app: the driver has no %s\n", name);
    exit(1);
  }
  return p;
}
#define FN(type, var, p) \
  type var;              \
  do {                   \
    void *p_ = (p);      \
    memcpy(&var, &p_, sizeof var); \
  } while (0)

#define CU(call)                                                     \
  do {                                                               \
    int r_ = (call);                                                 \
    if (r_ != 0) {                                                   \
      fprintf(stderr, "%s:%d %s: CUresult %d\n", __FILE__, __LINE__, #call, r_); \
      exit(1);                                                       \
    }                                                                \
  } while (0)

static htod_fn htod;
static dtoh_fn dtoh;

static int round_trip(uint64_t d, size_t n, int seed) {
  unsigned char *in = malloc(n), *out = malloc(n);
  for (size_t i = 0; i < n; i++) in[i] = (unsigned char)(i * 7 + (size_t)seed);
  CU(htod(d, in, n));
  memset(out, 0, n);
  CU(dtoh(out, d, n));
  int ok = memcmp(in, out, n) == 0;
  free(in);
  free(out);
  return ok;
}

int main(void) {
  driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == NULL) {
    fprintf(stderr, "dlopen_app: %s\n", dlerror());
    return 1;
  }
  FN(init_fn, init, need("cuInit"));
  FN(device_get_fn, device_get, need("cuDeviceGet"));
  FN(retain_fn, retain, need("cuDevicePrimaryCtxRetain"));
  FN(release_fn, release, need("cuDevicePrimaryCtxRelease_v2"));
  FN(set_current_fn, set_current, need("cuCtxSetCurrent"));
  FN(alloc_fn, alloc, need("cuMemAlloc_v2"));
  FN(free_fn, dfree, need("cuMemFree_v2"));
  FN(get_proc_v2_fn, get_proc_v2, need("cuGetProcAddress_v2"));
  memcpy(&htod, &(void *){need("cuMemcpyHtoD_v2")}, sizeof htod);
  memcpy(&dtoh, &(void *){need("cuMemcpyDtoH_v2")}, sizeof dtoh);

  int dev = 0, ok = 1, allocs = 0, found = 0;
  void *ctx = NULL, *p = NULL;
  CU(init(0));
  CU(device_get(&dev, 0));
  CU(retain(&ctx, dev));
  CU(set_current(ctx));

  /* dlsym's cuMemAlloc_v2, freed by cuGetProcAddress's cuMemFree. */
  uint64_t d = 0;
  CU(alloc(&d, 1 << 20));
  allocs++;
  ok &= round_trip(d, 1 << 20, 1);
  CU(get_proc_v2("cuMemFree", &p, 12000, 0, &found));
  FN(free_fn, gp_free, p);
  CU(gp_free(d));

  /* cuGetProcAddress's cuMemAlloc (CUDA 12), freed by dlsym's cuMemFree_v2. */
  CU(get_proc_v2("cuMemAlloc", &p, 12000, 0, &found));
  FN(alloc_fn, gp_alloc, p);
  CU(gp_alloc(&d, 3 << 20));
  allocs++;
  ok &= round_trip(d, 3 << 20, 2);
  CU(dfree(d));

  /* The cuGetProcAddress that cuGetProcAddress gives for itself, asked for cuMemAlloc. */
  CU(get_proc_v2("cuGetProcAddress", &p, 12000, 0, &found));
  FN(get_proc_v2_fn, gp_self, p);
  CU(gp_self("cuMemAlloc", &p, 12000, 0, &found));
  FN(alloc_fn, gp_alloc2, p);
  CU(gp_alloc2(&d, 2 << 20));
  allocs++;
  ok &= round_trip(d, 2 << 20, 3);
  CU(dfree(d));

  /* CUDA 11's cuGetProcAddress at CUDA 11.3, where the driver still has it. */
  void *v1 = dlsym(driver, "cuGetProcAddress");
  if (v1 != NULL) {
    FN(get_proc_fn, gp_v1, v1);
    CU(gp_v1("cuMemAlloc", &p, 11030, 0));
    FN(alloc_fn, gp_alloc3, p);
    CU(gp_alloc3(&d, 4 << 20));
    allocs++;
    ok &= round_trip(d, 4 << 20, 4);
    CU(gp_free(d));
  }

  CU(release(dev));
  printf("dlopen_app: %s, %d cuMemAlloc\n", ok ? "ok" : "FAILED", allocs);
  return ok ? 0 : 1;
}
