/* driver_app: a program on the CUDA driver API (linked with -lcuda), for the LD_PRELOAD tests.
 * It allocates in the primary context with cuMemAlloc, through a pointer from
 * cuGetProcAddress, and with cuMemAllocAsync on a stream, which it then destroys (the shim
 * waits for it first); and in a context of its own, which the shim must leave to the driver.
 * Every buffer round-trips data, checked.
 * Prints "driver_app: ok" and exits 0 when every check passed. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CU(call)                                                              \
  do {                                                                        \
    CUresult r_ = (call);                                                     \
    if (r_ != CUDA_SUCCESS) {                                                 \
      const char *name_ = "?";                                                \
      cuGetErrorName(r_, &name_);                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, name_);    \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);

static int round_trip(CUdeviceptr d, size_t n, int seed) {
  unsigned char *in = malloc(n), *out = malloc(n);
  for (size_t i = 0; i < n; i++) in[i] = (unsigned char)(i * 7 + (size_t)seed);
  CU(cuMemcpyHtoD(d, in, n));
  memset(out, 0, n);
  CU(cuMemcpyDtoH(out, d, n));
  int ok = memcmp(in, out, n) == 0;
  free(in);
  free(out);
  return ok;
}

int main(void) {
  CUdevice dev;
  CUcontext primary, own;
  int ok = 1;
  CU(cuInit(0));
  CU(cuDeviceGet(&dev, 0));
  CU(cuDevicePrimaryCtxRetain(&primary, dev));
  CU(cuCtxSetCurrent(primary));

  CUdeviceptr d;
  CU(cuMemAlloc(&d, 1 << 20));
  ok &= round_trip(d, 1 << 20, 1);
  CU(cuMemFree(d));

  void *pa = NULL, *pf = NULL;
  CUdriverProcAddressQueryResult found;
  CU(cuGetProcAddress("cuMemAlloc", &pa, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found));
  CU(cuGetProcAddress("cuMemFree", &pf, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found));
  alloc_fn alloc;
  free_fn release;
  memcpy(&alloc, &pa, sizeof alloc);
  memcpy(&release, &pf, sizeof release);
  CU(alloc(&d, 3 << 20));
  ok &= round_trip(d, 3 << 20, 2);
  CU(release(d));

  CUstream s;
  CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CU(cuMemAllocAsync(&d, 5 << 20, s));
  CU(cuStreamSynchronize(s));
  ok &= round_trip(d, 5 << 20, 3);
  CU(cuMemFreeAsync(d, s));
  CU(cuStreamSynchronize(s));
  CU(cuStreamDestroy(s));

  /* A context of the program's own: gpupool's memory would not be valid in it. */
#if CUDA_VERSION >= 13000
  CU(cuCtxCreate(&own, NULL, 0, dev));
#else
  CU(cuCtxCreate(&own, 0, dev));
#endif
  CU(cuMemAlloc(&d, 1 << 20));
  ok &= round_trip(d, 1 << 20, 4);
  CU(cuMemFree(d));
  CU(cuCtxDestroy(own));
  CU(cuCtxSetCurrent(primary));
  CU(cuDevicePrimaryCtxRelease(dev));
  printf("driver_app: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
