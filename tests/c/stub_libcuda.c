/* A partial CUDA driver, as some containers ship: every function gpupool calls except
 * cuMemAlloc_v2. gpupool must refuse it at start with DRIVER_UNAVAILABLE naming the missing
 * function, and print nothing (cudarc panics on a missing symbol when a call first reaches it).
 * Only looked up, never called: the signatures do not matter. */
#define STUB(name) \
  int name(void); \
  int name(void) { return 999; }
STUB(cuInit)
STUB(cuGetErrorName)
STUB(cuDeviceGetCount)
STUB(cuDeviceGet)
STUB(cuDevicePrimaryCtxRetain)
STUB(cuCtxPushCurrent_v2)
STUB(cuCtxPopCurrent_v2)
STUB(cuCtxGetCurrent)
STUB(cuCtxGetDevice)
STUB(cuCtxSynchronize)
STUB(cuMemFree_v2)
STUB(cuMemGetInfo_v2)
STUB(cuEventCreate)
STUB(cuEventRecord)
STUB(cuEventQuery)
STUB(cuEventSynchronize)
STUB(cuEventDestroy_v2)
/* Pinned host memory (gpupool_host_*), required at start too. */
STUB(cuMemHostAlloc)
STUB(cuMemFreeHost)
STUB(cuMemHostRegister_v2)
STUB(cuMemHostUnregister)
STUB(cuStreamGetCtx)
