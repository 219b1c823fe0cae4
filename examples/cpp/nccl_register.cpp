// Registers gpupool's memory with an NCCL communicator once per mapped range: before an
// all-reduce, each buffer's whole mapped range (gpupool_segment_mapped_range: an ordinary
// segment whole, or the run of pages an expandable segment has mapped side by side) is
// registered with ncclCommRegister unless it is already, never a tensor alone; a segment
// observer deregisters (ncclCommDeregister) every range that a GPUPOOL_SEGMENT_FREE or
// GPUPOOL_SEGMENT_UNMAP overlaps, before the memory goes, and a range that grew is registered
// again whole at its next use. PyTorch's ProcessGroupNCCL registers each segment event's range
// instead (its allocator trace tracker: one registration per growth of an expandable segment).
// Then runs an all-reduce on blocks from gpupool and checks it. Then a private pool whose
// segments come from ncclMemAlloc (gpupool_pool_create_with_allocator_aligned, PyTorch's
// torch.cuda.MemPool(allocator) for NVLink SHARP, its blocks not split below 2 MiB): the
// all-reduce again on its blocks, each at a multiple of 2 MiB, and its segments back through
// ncclMemFree.
//
// One process, one rank per GPU (argv[1] ranks, default every visible GPU), each rank on its
// own thread with its own communicator, stream and pool; the observer deregisters with the
// communicator of the segment's device. One GPU gives a communicator of one rank.
//
// Build (scripts/gpu.sh, section nccl): c++ -std=c++17 nccl_register.cpp -I<prefix>/include
//   -I<dir of nccl.h> -I<cuda>/include -L<prefix>/lib -lgpupool <libnccl.so.2> -lcudart -pthread
// Run twice: as is (expandable segments: ncclCommRegister on runs of an expandable segment)
// and with GPUPOOL_CONF=expandable_segments:False (ordinary segments). Exit status 0 when
// every check holds.

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <thread>
#include <vector>

#include <gpupool.h>

#define CHECK(what, ok)                                                                         \
  do {                                                                                          \
    if (!(ok)) {                                                                                \
      std::fprintf(stderr, "nccl_register: %s failed (%s:%d)\n", what, __FILE__, __LINE__);     \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)
#define CUDA(call) CHECK(#call, (call) == cudaSuccess)
#define NCCL(call) CHECK(#call, (call) == ncclSuccess)
#define POOL(call)                                                                              \
  do {                                                                                          \
    if ((call) != GPUPOOL_SUCCESS) {                                                            \
      std::fprintf(stderr, "nccl_register: %s: %s\n", #call, gpupool_last_error_message());     \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace {

// The ranges registered with the communicator, by start address: (bytes, NCCL's handle).
struct Registry {
  ncclComm_t comm;
  std::map<char *, std::pair<size_t, void *>> ranges;
  size_t bytes = 0;
  int registered = 0, deregistered = 0, failures = 0, asks = 0;

  // Deregisters every range overlapping [at, at + n).
  void drop(char *at, size_t n) {
    auto it = ranges.upper_bound(at);
    if (it != ranges.begin()) it = std::prev(it);
    while (it != ranges.end() && it->first < at + n) {
      if (it->first + it->second.first <= at) {
        ++it;
        continue;
      }
      if (ncclCommDeregister(comm, it->second.second) != ncclSuccess) failures++;
      deregistered++;
      bytes -= it->second.first;
      it = ranges.erase(it);
    }
  }

  // Makes sure the whole mapped range under `ptr` is registered, once: asks gpupool for it
  // (outside any observer: never from on_segment), and registers it unless that very range
  // is; a smaller range it replaces (the run grew) is deregistered first.
  void ensure(void *ptr) {
    gpupool_mapped_range_t r;
    POOL(gpupool_segment_mapped_range(ptr, &r, nullptr));
    asks++;
    char *at = static_cast<char *>(r.address);
    auto it = ranges.find(at);
    if (it != ranges.end() && it->second.first == r.bytes) return;
    drop(at, r.bytes);
    void *handle = nullptr;
    if (ncclCommRegister(comm, at, r.bytes, &handle) != ncclSuccess) {
      failures++;
      return;
    }
    ranges[at] = {r.bytes, handle};
    bytes += r.bytes;
    registered++;
  }

  // Whether [p, p + n) lies in one registered range.
  bool covers(const void *p, size_t n) const {
    const char *c = static_cast<const char *>(p);
    auto it = ranges.upper_bound(const_cast<char *>(c));
    if (it == ranges.begin()) return false;
    it = std::prev(it);
    return c + n <= it->first + it->second.first;
  }
};

// Runs on the thread of the gpupool call that made or gives back the memory; calls NCCL only
// (never gpupool). FREE and UNMAP come before the memory goes back to the driver: what they
// overlap is deregistered then. ALLOC and MAP register nothing: the next use of a block there
// registers its whole range (Registry::ensure).
void on_segment(void *user, const gpupool_segment_event_t *e) {
  auto *r = static_cast<Registry *>(user);
  if (e->kind == GPUPOOL_SEGMENT_FREE || e->kind == GPUPOOL_SEGMENT_UNMAP)
    r->drop(static_cast<char *>(e->address), e->bytes);
}

// The pool's allocator: NCCL's (called with gpupool's pool locked; calls NCCL only).
int nccl_alloc(void *user, size_t bytes, int device, gpupool_stream_t, void **ptr) {
  auto *calls = static_cast<int *>(user);
  int old = 0;
  if (cudaGetDevice(&old) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return 1;
  ncclResult_t r = ncclMemAlloc(ptr, bytes);
  cudaSetDevice(old);
  if (r != ncclSuccess) return 1;
  calls[0]++;
  return 0;
}

void nccl_free(void *user, void *ptr, size_t, int, gpupool_stream_t) {
  auto *calls = static_cast<int *>(user);
  if (ncclMemFree(ptr) == ncclSuccess) calls[1]++;
}

// An all-reduce (sum over `ranks` ranks) of `count` floats on two blocks allocated now on
// `stream` of this rank's device, checked, then freed. Rank r sends its input times r + 1.
// `align`: the blocks must start at multiples of it (a pool not split below it), or 0.
void all_reduce_checked(Registry &reg, int rank, int ranks, cudaStream_t stream, size_t count, size_t align = 0) {
  float *send = nullptr, *recv = nullptr;
  POOL(gpupool_malloc(reinterpret_cast<void **>(&send), count * sizeof(float), rank, stream));
  POOL(gpupool_malloc(reinterpret_cast<void **>(&recv), count * sizeof(float), rank, stream));
  if (align != 0) {
    CHECK("blocks of the aligned pool start at multiples of its alignment",
          reinterpret_cast<uintptr_t>(send) % align == 0 && reinterpret_cast<uintptr_t>(recv) % align == 0);
  }
  reg.ensure(send);
  reg.ensure(recv);
  CHECK("both buffers lie in registered ranges",
        reg.covers(send, count * sizeof(float)) && reg.covers(recv, count * sizeof(float)));
  std::vector<float> host(count);
  for (size_t i = 0; i < count; i++) host[i] = static_cast<float>(i % 1000) * 0.5f * static_cast<float>(rank + 1);
  CUDA(cudaMemcpyAsync(send, host.data(), count * sizeof(float), cudaMemcpyHostToDevice, stream));
  CUDA(cudaMemsetAsync(recv, 0, count * sizeof(float), stream));
  NCCL(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, reg.comm, stream));
  std::vector<float> back(count);
  CUDA(cudaMemcpyAsync(back.data(), recv, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CUDA(cudaStreamSynchronize(stream));
  // Exact in float: at most 499.5 times ranks (ranks + 1) / 2.
  const float factor = static_cast<float>(ranks * (ranks + 1) / 2);
  for (size_t i = 0; i < count; i++)
    CHECK("the all-reduce gives the sum of every rank's input", back[i] == static_cast<float>(i % 1000) * 0.5f * factor);
  POOL(gpupool_free(send));
  POOL(gpupool_free(recv));
}

int64_t reserved(int device) {
  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  POOL(gpupool_stats(device, &st));
  return st.reserved_bytes.all.current;
}

// The observer's user data: one registry per device, each touched only by its rank's thread
// (a segment event comes on the thread whose gpupool call made or gives back the segment).
struct Registries {
  std::vector<Registry> by_device;
};

void on_any_segment(void *user, const gpupool_segment_event_t *e) {
  auto *all = static_cast<Registries *>(user);
  if (e->device < 0 || static_cast<size_t>(e->device) >= all->by_device.size()) return;
  on_segment(&all->by_device[static_cast<size_t>(e->device)], e);
}

const size_t kSizes[] = {1u << 10, 3u << 20, 64u << 20};

// One rank: its communicator, all-reduces on gpupool's blocks, then on a pool over
// ncclMemAlloc. Returns through CHECK (exit) on any failure.
void run_rank(Registry &reg, int rank, int ranks, const ncclUniqueId &id) {
  CUDA(cudaSetDevice(rank));
  NCCL(ncclCommInitRank(&reg.comm, ranks, id, rank));
  cudaStream_t stream;
  CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (size_t count : kSizes) {
    all_reduce_checked(reg, rank, ranks, stream, count);
    CHECK("the registered bytes are reserved bytes", static_cast<int64_t>(reg.bytes) <= reserved(rank));
    std::printf("rank %d of %d: all-reduce of %zu floats on gpupool blocks: checked; %zu bytes registered in %zu "
                "range(s) of %lld reserved; %d registrations for %d buffers\n",
                rank, ranks, count, reg.bytes, reg.ranges.size(), static_cast<long long>(reserved(rank)),
                reg.registered, reg.asks);
  }
  // A pool over ncclMemAlloc, its blocks not split below 2 MiB (the granularity NVLink SHARP
  // buffers need is a multiple of it; ncclMemAlloc's segments start at one): this thread's
  // allocations go there until the route ends.
  int nccl_calls[2] = {0, 0};
  uint64_t pool = 0;
  const size_t align = size_t(2) << 20;
  POOL(gpupool_pool_create_with_allocator_aligned(&pool, nccl_alloc, nccl_free, nccl_calls, align));
  POOL(gpupool_begin_allocate_to_pool_thread(rank, pool));
  for (size_t count : kSizes) all_reduce_checked(reg, rank, ranks, stream, count, align);
  POOL(gpupool_end_allocate_to_pool(rank, pool));
  CHECK("the pool's segments came from ncclMemAlloc", nccl_calls[0] > 0);
  CHECK("its segments are registered too, within reserved bytes", static_cast<int64_t>(reg.bytes) <= reserved(rank));
  std::printf("rank %d of %d: the same on a pool over ncclMemAlloc, blocks at multiples of 2 MiB: checked; %d segments "
              "from ncclMemAlloc\n", rank, ranks, nccl_calls[0]);
  POOL(gpupool_release_pool(rank, pool));
  CHECK("release_pool gave every segment back through ncclMemFree", nccl_calls[1] == nccl_calls[0]);
  CUDA(cudaStreamSynchronize(stream));
  POOL(gpupool_empty_cache(rank));
  CHECK("every range deregistered by empty_cache", reg.ranges.empty() && reg.bytes == 0 && reserved(rank) == 0);
  CHECK("NCCL accepted every registration", reg.failures == 0);
  NCCL(ncclCommDestroy(reg.comm));
  CUDA(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char **argv) {
  int devices = 0;
  CUDA(cudaGetDeviceCount(&devices));
  int ranks = argc > 1 ? std::atoi(argv[1]) : devices;
  CHECK("1 to the number of GPUs ranks", ranks >= 1 && ranks <= devices);
  int nccl_version = 0;
  NCCL(ncclGetVersion(&nccl_version));
  Registries regs;
  regs.by_device.resize(static_cast<size_t>(devices));
  ncclUniqueId id;
  NCCL(ncclGetUniqueId(&id));
  // Before the first allocation, so that every segment is told.
  POOL(gpupool_attach_segment_observer(on_any_segment, &regs));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; r++)
    threads.emplace_back([&regs, r, ranks, &id] { run_rank(regs.by_device[static_cast<size_t>(r)], r, ranks, id); });
  for (auto &t : threads) t.join();
  POOL(gpupool_detach_segment_observer(on_any_segment, &regs));
  int registered = 0, deregistered = 0;
  for (auto &r : regs.by_device) {
    registered += r.registered;
    deregistered += r.deregistered;
  }
  int asks = 0;
  for (auto &r : regs.by_device) asks += r.asks;
  std::printf("nccl_register: ok (NCCL %d, %d rank(s), %d registrations of whole mapped ranges for %d buffers, %d "
              "deregistrations)\n", nccl_version, ranks, registered, asks, deregistered);
  return 0;
}
