// PyTorch's c10 CUDACachingAllocator behind a C interface, for bench.c. Built only when CMake is
// given GPUPOOL_TORCH_DIR (the torch package directory, with include/ and lib/).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

extern "C" {
int torch_init(void) {
  c10::cuda::CUDACachingAllocator::init(c10::cuda::device_count());
  return 0;
}
void *torch_alloc(size_t n, void *stream) {
  return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, static_cast<cudaStream_t>(stream));
}
void torch_free(void *p) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
long long torch_reserved_peak(void) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(0).reserved_bytes[0].peak;
}
long long torch_device_allocs(void) { return c10::cuda::CUDACachingAllocator::getDeviceStats(0).num_device_alloc; }
void torch_reset_peak(void) { c10::cuda::CUDACachingAllocator::resetPeakStats(0); }
void torch_empty_cache(void) { c10::cuda::CUDACachingAllocator::emptyCache(); }
// Whether PyTorch's segments are expandable, from its memory snapshot: 1 if any is, 0 if there
// are segments and none is, -1 without segments: whether PYTORCH_CUDA_ALLOC_CONF's
// expandable_segments took effect in this process, seen in what PyTorch built rather than in
// the text it was given.
int torch_expandable_segments(void) {
  auto snap = c10::cuda::CUDACachingAllocator::snapshot();
  if (snap.segments.empty()) return -1;
  for (const auto &seg : snap.segments)
    if (seg.is_expandable) return 1;
  return 0;
}
}
