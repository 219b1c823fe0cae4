// libgpupool_torch_graphs.so: PyTorch's three private-pool hooks of the pluggable allocator
// (torch.cuda.graph, graph_pool_handle), on gpupool's private pools.
//
// PyTorch calls these hooks with C++ types (`c10::cuda::MempoolId_t` by value, a
// `std::function` filter), so they cannot be C functions of libgpupool: this file is built by
// the program's C++ compiler (CMake target gpupool_torch_graphs, installed beside
// libgpupool.so), and gpupool_torch.install() hands their addresses to the allocator object's
// set_begin_allocate_to_pool, set_end_allocate_to_pool_fn and set_release_pool. No PyTorch
// header is needed: `MempoolId_t` is `std::pair<CaptureId_t, CaptureId_t>` with `CaptureId_t`
// an `unsigned long long` (c10/cuda/CUDAGraphsC10Utils.h), and `cudaStream_t` is
// `CUstream_st *`; std::pair and std::function do not depend on libstdc++'s dual ABI.
//
// Rules, as PyTorch's native allocator keeps them (CUDACachingAllocator.cpp):
// - beginAllocateToPool(device, id, filter) creates the pool on first use and counts a use
//   (`create_or_incref_pool`); allocations on streams the filter accepts go to it (gpupool
//   calls the filter only while a route is active);
// - endAllocateToPool(device, id) ends the routes of that pool; their filters are kept until
//   the pool is released, since an allocation on another thread may still be calling one as
//   the route ends;
// - releasePool(device, id) takes a use back; the last one releases the pool's memory
//   (gpupool_release_pool), which PyTorch defers to its next cache release, and drops the
//   filters.
// A capture that fails leaks its pool under PyTorch: capture_end raises once
// cudaStreamEndCapture fails, having called endAllocateToPool or not, so releasePool is never
// called for that use, and CUDAGraph::pool() refuses to name the pool. gpupool_torch.graph()
// watches the capture instead: gpupool_torch_watch_captures(device) starts a list of the
// pools begun on the device, and gpupool_torch_end_watch(device, failed) stops it and, when the
// capture failed, takes back each listed use as releasePool would (ending the pool's routes
// first): a pool of its own is released, a pool shared through pool= keeps the uses of the
// graphs that captured into it before.
//
// A failure cannot be returned through PyTorch's hooks: it is written to stderr
// ("gpupool: ..."), as the other hooks of gpupool_torch.h do.
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "gpupool.h"

struct CUstream_st;
using cudaStream_t = CUstream_st *;
using MempoolId = std::pair<unsigned long long, unsigned long long>;
using Filter = std::function<bool(cudaStream_t)>;

namespace {

struct Pool {
  std::uint64_t id = 0;
  long uses = 0;
};

std::mutex mutex;
// gpupool's pool for each (device, PyTorch pool id).
std::map<std::pair<int, MempoolId>, Pool> pools;
// The pools begun on each watched device since its watch started (gpupool_torch_watch_captures).
std::map<int, std::vector<MempoolId>> watched;
// The filters of each gpupool pool's routes: alive until the pool is released.
std::map<std::pair<int, std::uint64_t>, std::vector<std::unique_ptr<Filter>>> filters;

int call_filter(void *user, gpupool_stream_t stream) {
  return (*static_cast<const Filter *>(user))(reinterpret_cast<cudaStream_t>(stream)) ? 1 : 0;
}

void report(gpupool_status status, const char *hook) {
  if (status != GPUPOOL_SUCCESS) {
    std::fprintf(stderr, "gpupool: %s: %s: %s\n", gpupool_status_string(status), hook, gpupool_last_error_message());
  }
}

// Releases `pool` on `device` and drops its filters; the caller holds `mutex`.
void release(int device, const Pool &pool, const char *hook) {
  report(gpupool_release_pool(device, pool.id), hook);
  filters.erase({device, pool.id});
}

}  // namespace

// PyTorch `beginAllocateToPool(device, mempool_id, filter)`.
extern "C" void gpupool_torch_begin_allocate_to_pool(int device, MempoolId mempool, Filter filter) {
  std::lock_guard<std::mutex> lock(mutex);
  Pool &pool = pools[{device, mempool}];
  if (pool.id == 0) {
    gpupool_status status = gpupool_pool_create(&pool.id);
    if (status != GPUPOOL_SUCCESS) {
      report(status, "beginAllocateToPool");
      pools.erase({device, mempool});
      return;
    }
  }
  auto owned = std::make_unique<Filter>(std::move(filter));
  gpupool_status status = gpupool_begin_allocate_to_pool_filter(device, pool.id, call_filter, owned.get());
  if (status != GPUPOOL_SUCCESS) {
    report(status, "beginAllocateToPool");
    return;
  }
  pool.uses++;
  filters[{device, pool.id}].push_back(std::move(owned));
  auto w = watched.find(device);
  if (w != watched.end()) w->second.push_back(mempool);
}

// PyTorch `endAllocateToPool(device, mempool_id)`.
extern "C" void gpupool_torch_end_allocate_to_pool(int device, MempoolId mempool) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find({device, mempool});
  if (it == pools.end()) return;
  report(gpupool_end_allocate_to_pool(device, it->second.id), "endAllocateToPool");
}

// PyTorch `releasePool(device, mempool_id)`.
extern "C" void gpupool_torch_release_pool(int device, MempoolId mempool) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find({device, mempool});
  if (it == pools.end() || --it->second.uses > 0) return;
  release(device, it->second, "releasePool");
  pools.erase(it);
}

// Starts listing the pools begun on `device` (a watch already running starts again): one
// capture at a time per device, as PyTorch captures. Thread-safe (the hooks' one mutex).
extern "C" void gpupool_torch_watch_captures(int device) {
  std::lock_guard<std::mutex> lock(mutex);
  watched[device].clear();
}

// Stops the watch of `device`; when `failed` (nonzero), takes back the use of each pool begun
// since it started, as the releasePool that PyTorch never calls for a failed capture: the
// pool's routes end, and a pool left with no use is released (gpupool_release_pool; its
// failure is written to stderr, as the hooks' are). Returns how many pools it released: 0
// without a watch or a failure. Thread-safe (the hooks' one mutex).
extern "C" int gpupool_torch_end_watch(int device, int failed) {
  std::lock_guard<std::mutex> lock(mutex);
  auto w = watched.find(device);
  if (w == watched.end()) return 0;
  std::vector<MempoolId> begun = std::move(w->second);
  watched.erase(w);
  if (!failed) return 0;
  int released = 0;
  for (const MempoolId &mempool : begun) {
    auto it = pools.find({device, mempool});
    if (it == pools.end()) continue;
    // No route of this device's pool outlives a failed capture (captures run one at a time);
    // ending one that has ended already is refused, harmlessly.
    (void)gpupool_end_allocate_to_pool(device, it->second.id);
    if (--it->second.uses > 0) continue;
    release(device, it->second, "a failed capture's pool");
    pools.erase(it);
    released++;
  }
  return released;
}

// gpupool's id for PyTorch's pool (first, second) on `device`; 0 when there is none.
extern "C" std::uint64_t gpupool_torch_pool_id(int device, unsigned long long first, unsigned long long second) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find({device, MempoolId(first, second)});
  return it == pools.end() ? 0 : it->second.id;
}
