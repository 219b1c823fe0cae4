// gpupool as an RMM memory resource (RAPIDS Memory Manager 26.x, whose resources follow CCCL's
// cuda::mr::resource concept): gpupool::rmm_resource allocates and frees through gpupool.h, so
// that code written against RMM (rmm::device_buffer, rmm::device_uvector, cuDF, ...) shares one
// cache, one set of statistics and one snapshot with PyTorch and everything else on gpupool.
//
//   #include <gpupool_rmm.hpp>
//   gpupool::rmm_resource mr;                         // the current device (or rmm_resource(2))
//   rmm::mr::set_current_device_resource(mr);         // RMM keeps a copy
//   rmm::device_buffer buf(bytes, stream);            // from gpupool's cache, on `stream`
//
// Needs RMM's and CCCL's headers (PyPI's librmm-cu12 / librmm-cu13 wheels ship both) and
// links RMM's library (its exceptions) and gpupool. Header-only; docs/rmm.md says what differs
// from RMM's own pool_memory_resource.
#ifndef GPUPOOL_RMM_HPP
#define GPUPOOL_RMM_HPP

#include <cstddef>
#include <string>

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <rmm/aligned.hpp>
#include <rmm/error.hpp>

#include "gpupool.h"

namespace gpupool {

// An RMM device memory resource over gpupool's process-wide allocator. Copies are equal when
// they name the same device and all share the one allocator; the resource holds no memory of its
// own, so it may be destroyed while blocks it handed out live (they stay gpupool's).
// Thread-safe, as gpupool.h is.
class rmm_resource {
 public:
  // `device`: the CUDA ordinal to allocate on, or -1 (the default) for the calling thread's
  // current device at each allocation, as RMM's cuda_memory_resource does.
  explicit rmm_resource(int device = -1) noexcept : device_{device} {}

  // `bytes` of device memory for use on `stream` (gpupool_malloc): reused later only by
  // allocations on the same stream, as RMM's pool does per stream. 0 bytes gives nullptr.
  // `alignment`: a power of two up to 512 (gpupool's blocks are 512-byte aligned; RMM asks for
  // 256). Throws rmm::out_of_memory when gpupool is out of memory after its release-and-retry,
  // rmm::bad_alloc for any other failure (the message is gpupool's).
  void* allocate(cuda::stream_ref stream, std::size_t bytes,
                 std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) {
    check_alignment(alignment);
    void* ptr = nullptr;
    gpupool_status status = gpupool_malloc(&ptr, bytes, device_, as_stream(stream));
    if (status != GPUPOOL_SUCCESS) fail(status);
    return ptr;
  }

  // Gives `ptr` back (gpupool_free), last used on `stream`: when `stream` is not the stream the
  // block was allocated for, the block is first recorded on it (gpupool_record_stream), so it
  // is reused only after `stream`'s work queued so far, as RMM's deallocate promises. `bytes` and
  // `alignment` are ignored (gpupool knows the block). Never throws: a pointer gpupool did not
  // hand out is ignored (gpupool_last_error_message() says why).
  void deallocate(cuda::stream_ref stream, void* ptr, std::size_t bytes,
                  std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept {
    (void)bytes;
    (void)alignment;
    if (ptr == nullptr) return;
    // A block's own stream is a no-op for gpupool_record_stream, as for PyTorch's.
    (void)gpupool_record_stream(ptr, as_stream(stream));
    (void)gpupool_free(ptr);
  }

  // allocate on the legacy default stream. Differs from cudaMalloc (RMM's
  // cuda_memory_resource::allocate_sync): a cached block is ordered after earlier work on the
  // legacy default stream, not after the whole device; work on non-blocking streams that uses
  // it must wait for the legacy stream (or use allocate with its own stream).
  void* allocate_sync(std::size_t bytes, std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) {
    return allocate(cuda::stream_ref{cudaStream_t{}}, bytes, alignment);
  }

  // deallocate on the legacy default stream.
  void deallocate_sync(void* ptr, std::size_t bytes,
                       std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept {
    deallocate(cuda::stream_ref{cudaStream_t{}}, ptr, bytes, alignment);
  }

  // The device given at construction (-1: the current device at each allocation).
  [[nodiscard]] int device() const noexcept { return device_; }

  [[nodiscard]] bool operator==(rmm_resource const& other) const noexcept { return device_ == other.device_; }
  [[nodiscard]] bool operator!=(rmm_resource const& other) const noexcept { return !(*this == other); }

  // The memory is device memory (cuda::mr::device_accessible), as RMM's device resources.
  friend void get_property(rmm_resource const&, cuda::mr::device_accessible) noexcept {}

 private:
  static gpupool_stream_t as_stream(cuda::stream_ref stream) noexcept {
    return reinterpret_cast<gpupool_stream_t>(stream.get());
  }

  static void check_alignment(std::size_t alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > 512) {
      throw rmm::bad_alloc("gpupool::rmm_resource: alignment " + std::to_string(alignment) +
                           " is not a power of two up to 512 (gpupool's blocks are 512-byte aligned)");
    }
  }

  [[noreturn]] static void fail(gpupool_status status) {
    std::string msg = std::string("gpupool::rmm_resource: ") + gpupool_last_error_message();
    if (status == GPUPOOL_ERROR_OUT_OF_MEMORY) throw rmm::out_of_memory(msg);
    throw rmm::bad_alloc(msg);
  }

  int device_;
};

static_assert(cuda::mr::resource_with<rmm_resource, cuda::mr::device_accessible>,
              "gpupool::rmm_resource is an RMM device resource");

}  // namespace gpupool

#endif  // GPUPOOL_RMM_HPP
