// PyTorch's caching host allocator (at::getHostAllocator(c10::DeviceType::CUDA), what pin_memory() and
// non_blocking copies use) behind a C interface, for bench_host.c. Built only when CMake is
// given GPUPOOL_TORCH_DIR and GPUPOOL_BENCH_HOST_TORCH is on.
#include <ATen/core/CachingHostAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <unordered_map>

// PyTorch frees a block when its DataPtr dies: the live ones are kept here by address (the
// bench is single-threaded). Leaked on purpose, so that nothing runs at exit after CUDA.
static std::unordered_map<void *, at::DataPtr> *live = new std::unordered_map<void *, at::DataPtr>();

extern "C" {
void *torch_host_alloc(size_t n) {
  at::DataPtr dp = at::getHostAllocator(c10::DeviceType::CUDA)->allocate(n);
  void *p = dp.get();
  live->emplace(p, std::move(dp));
  return p;
}
// PyTorch CachingHostAllocator_recordEvent: the block is reused only after `stream` passed.
int torch_host_record_event(void *p, void *stream) {
  auto it = live->find(p);
  if (it == live->end()) return 0;
  c10::cuda::CUDAStream s = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), 0);
  return at::getHostAllocator(c10::DeviceType::CUDA)->record_event(p, it->second.get_context(), s.unwrap()) ? 1 : 0;
}
void torch_host_free(void *p) { live->erase(p); }
// ns per allocate+free pair of `n` bytes, timed here with the DataPtr on the stack: the map
// above would add its own cost to PyTorch's figure.
double torch_host_pair_ns(size_t n, int pairs) {
  at::HostAllocator *a = at::getHostAllocator(c10::DeviceType::CUDA);
  { at::DataPtr warm = a->allocate(n); }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < pairs; i++) {
    at::DataPtr d = a->allocate(n);
    static_cast<volatile char *>(d.get())[0] = static_cast<char>(i);
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / pairs;
}
void torch_host_empty_cache(void) { at::getHostAllocator(c10::DeviceType::CUDA)->empty_cache(); }
}
