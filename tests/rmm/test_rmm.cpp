// gpupool::rmm_resource (examples/cpp/gpupool_rmm.hpp) against RMM's real headers (PyPI's
// librmm wheel) on the simulated device: RMM's resource_ref types take it, allocations land in
// gpupool's statistics, a block freed on its stream is reused there and not on another, a block
// freed on another stream waits for that stream's work, out of memory and bad alignments throw
// RMM's exceptions, and equality follows the device. scripts/test.sh builds and runs it:
//
//   c++ -std=c++17 -I<librmm>/include -I<librmm>/include/rapids -I<cuda>/include -Iinclude
//       -Iexamples/cpp tests/rmm/test_rmm.cpp -lgpupool -lrmm
//   GPUPOOL_DRIVER=sim ./test_rmm
//
// Prints "N passed, N failed"; exits 1 when a check failed.
#include <gpupool_rmm.hpp>
#include <gpupool_testing.h>

#include <rmm/resource_ref.hpp>

#include <cstdio>
#include <cstring>

static int passed = 0, failed = 0;

static void check(bool ok, const char* what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::fprintf(stderr, "FAILED: %s\n", what);
  }
}

static gpupool_stats_t stats(int device) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  gpupool_stats(device, &s);
  return s;
}

static cuda::stream_ref stream(std::uintptr_t n) { return cuda::stream_ref{reinterpret_cast<cudaStream_t>(n)}; }

int main() {
  constexpr std::size_t MiB = 1 << 20;
  // RMM's references want the alignment spelled out (its default is deprecated).
  constexpr std::size_t A = rmm::CUDA_ALLOCATION_ALIGNMENT;
  gpupool::rmm_resource mr;
  rmm::device_async_resource_ref ref{mr};
  rmm::device_resource_ref sync_ref{mr};

  // Through RMM's type-erased reference, on stream 0x10.
  const auto before = stats(0);
  void* a = ref.allocate(stream(0x10), 3 * MiB, A);
  check(a != nullptr, "allocate through device_async_resource_ref");
  check(stats(0).allocated_bytes.all.current == before.allocated_bytes.all.current + (int64_t)(3 * MiB),
        "gpupool's statistics count RMM's block");
  ref.deallocate(stream(0x10), a, 3 * MiB, A);
  check(stats(0).allocated_bytes.all.current == before.allocated_bytes.all.current, "deallocate gives it back");
  void* again = ref.allocate(stream(0x10), 3 * MiB, A);
  check(again == a, "a block freed on its stream is reused on that stream");
  void* other = ref.allocate(stream(0x20), 3 * MiB, A);
  check(other != a, "and not on another stream");
  ref.deallocate(stream(0x20), other, 3 * MiB, A);

  // Freed on another stream whose work is still queued: not reused until that work is done.
  gpupool_sim_hold_stream(reinterpret_cast<gpupool_stream_t>(0x30));
  ref.deallocate(stream(0x30), again, 3 * MiB, A);
  void* while_held = ref.allocate(stream(0x10), 3 * MiB, A);
  check(while_held != a, "a block freed on a busy other stream waits for it");
  gpupool_sim_release_stream(reinterpret_cast<gpupool_stream_t>(0x30));
  void* after_release = ref.allocate(stream(0x10), 3 * MiB, A);
  check(after_release == a, "and is reused once that stream's work is done");
  ref.deallocate(stream(0x10), after_release, 3 * MiB, A);
  ref.deallocate(stream(0x10), while_held, 3 * MiB, A);

  // The synchronous interface: the legacy default stream.
  void* s = sync_ref.allocate_sync(1000, A);
  check(s != nullptr && stats(0).allocation.all.current == before.allocation.all.current + 1, "allocate_sync");
  sync_ref.deallocate_sync(s, 1000, A);
  check(ref.allocate(stream(0), 0, A) == nullptr, "0 bytes gives nullptr");

  // Errors: RMM's exceptions with gpupool's message; nothing changes.
  const auto mid = stats(0);
  bool oom = false;
  try {
    (void)ref.allocate(stream(0x10), std::size_t{1} << 40, A);
  } catch (rmm::out_of_memory const& e) {
    oom = std::strstr(e.what(), "out of memory") != nullptr;
  }
  check(oom, "out of memory throws rmm::out_of_memory with gpupool's message");
  int bad_alignments = 0;
  for (std::size_t alignment : {std::size_t{0}, std::size_t{3}, std::size_t{1024}}) {
    try {
      (void)mr.allocate(stream(0x10), 100, alignment);
    } catch (rmm::bad_alloc const&) {
      ++bad_alignments;
    }
  }
  check(bad_alignments == 3, "alignments that are not a power of two up to 512 throw rmm::bad_alloc");
  check(mr.allocate(stream(0x10), 100, 512) != nullptr, "alignment 512 is served");
  bool bad_device = false;
  try {
    (void)gpupool::rmm_resource{7}.allocate(stream(0x10), 100);
  } catch (rmm::bad_alloc const& e) {
    bad_device = std::strstr(e.what(), "device 7") != nullptr;
  }
  check(bad_device, "a device out of range throws rmm::bad_alloc");
  int local = 0;
  mr.deallocate(stream(0x10), &local, 4);  // not gpupool's: ignored
  check(stats(0).num_ooms == mid.num_ooms + 1 && stats(0).allocation.all.current == mid.allocation.all.current + 1,
        "failures change nothing but num_ooms (and the 512-aligned block above)");

  // Equality: by device. Device 1 allocates there.
  gpupool::rmm_resource mr1{1};
  check(mr == gpupool::rmm_resource{} && !(mr == mr1) && mr.device() == -1 && mr1.device() == 1, "equality by device");
  rmm::device_async_resource_ref ref1{mr1};
  void* d1 = ref1.allocate(stream(0x10), MiB, A);
  check(stats(1).allocated_bytes.all.current == (int64_t)MiB, "rmm_resource{1} allocates on device 1");
  ref1.deallocate(stream(0x10), d1, MiB, A);

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
