/* What unmapping a sleeping pool's pages costs, page by page (cuMemUnmap per mapping, as
 * gpupool and PyTorch's ExpandableSegment::unmapHandles do) against one cuMemUnmap over a run
 * of adjacent mappings, then cuMemRelease per handle; and mapping them again with one
 * cuMemSetAccess per page against one per run. N pages of P MiB (default 205 of 20 MiB: a 4 GiB
 * pool), best of 3, milliseconds. Usage: vmm_unmap_cost [N] [P] [device]. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CU(call)                                                          \
  do {                                                                    \
    CUresult r_ = (call);                                                 \
    if (r_ != CUDA_SUCCESS) {                                             \
      const char *s_ = "?";                                               \
      cuGetErrorName(r_, &s_);                                            \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, s_); \
      exit(1);                                                            \
    }                                                                     \
  } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 205, dev = argc > 3 ? atoi(argv[3]) : 0;
  size_t page = (size_t)(argc > 2 ? atoi(argv[2]) : 20) << 20;
  CUdevice d;
  CUcontext ctx;
  CU(cuInit(0));
  CU(cuDeviceGet(&d, dev));
  CU(cuDevicePrimaryCtxRetain(&ctx, d));
  CU(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, page * n, 0, 0, 0));
  CUmemGenericAllocationHandle *h = malloc(sizeof *h * n);
  double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9};
  for (int round = 0; round < 6; round++) {
    int whole = round % 2; /* alternate: per page, then one call over the run */
    double t = now_ms();
    for (int i = 0; i < n; i++) {
      CU(cuMemCreate(&h[i], page, &prop, 0));
      CU(cuMemMap(base + page * i, page, 0, h[i], 0));
      if (!whole) CU(cuMemSetAccess(base + page * i, page, &acc, 1));
    }
    if (whole) CU(cuMemSetAccess(base, page * n, &acc, 1));
    double map = now_ms() - t;
    CU(cuMemsetD8(base, 1, page * n));
    CU(cuCtxSynchronize());
    t = now_ms();
    if (whole)
      CU(cuMemUnmap(base, page * n));
    else
      for (int i = 0; i < n; i++) CU(cuMemUnmap(base + page * i, page));
    double unmap = now_ms() - t;
    t = now_ms();
    for (int i = 0; i < n; i++) CU(cuMemRelease(h[i]));
    double rel = now_ms() - t;
    int k = whole ? 3 : 0;
    if (map < best[k]) best[k] = map;
    if (unmap < best[k + 1]) best[k + 1] = unmap;
    if (!whole && rel < best[2]) best[2] = rel;
  }
  printf("%d pages of %zu MiB on device %d, best of 3, ms: create+map+access per page %.2f, unmap per page %.2f, "
         "release %.2f; create+map, access once %.2f, unmap once %.2f\n",
         n, page >> 20, dev, best[0], best[1], best[2], best[3], best[4]);
  CU(cuMemAddressFree(base, page * n));
  return 0;
}
