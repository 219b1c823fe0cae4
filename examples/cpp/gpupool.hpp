// gpupool.hpp: a header-only C++17 wrapper over gpupool's C API.
//
//   gpupool::buffer b(n * sizeof(float), stream);   // gpupool_malloc on the current device
//   kernel<<<g, t, 0, stream>>>(b.as<float>());
//   b.record_stream(other);                          // also used on `other`
//   // ~buffer: gpupool_free; the block is reused on `stream` only after `other` has passed
//
//   { gpupool::tag_scope t("encoder");               // blocks allocated here carry "encoder"
//     gpupool::buffer x(bytes, stream); }            // (gpupool_tag_stats, snapshots, reports)
//
// Errors become gpupool::error (a std::runtime_error with the status and gpupool's message).
// A buffer owns its block alone (move-only, like std::unique_ptr) and frees it when destroyed.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include "gpupool.h"

namespace gpupool {

class error : public std::runtime_error {
 public:
  error(gpupool_status status, const std::string &what)
      : std::runtime_error(what), status_(status) {}
  gpupool_status status() const noexcept { return status_; }

 private:
  gpupool_status status_;
};

// what(): "<status>: <function>: <why>"; gpupool's message names the function that failed.
inline void check(gpupool_status status) {
  if (status != GPUPOOL_SUCCESS) {
    throw error(status, std::string(gpupool_status_string(status)) + ": " + gpupool_last_error_message());
  }
}

// A block of device memory from gpupool, tied to the stream it was allocated for.
class buffer {
 public:
  buffer() noexcept = default;
  buffer(std::size_t bytes, gpupool_stream_t stream, int device = -1) : size_(bytes), stream_(stream) {
    check(gpupool_malloc(&ptr_, bytes, device, stream));
  }
  buffer(const buffer &) = delete;
  buffer &operator=(const buffer &) = delete;
  buffer(buffer &&other) noexcept { swap(other); }
  buffer &operator=(buffer &&other) noexcept {
    if (this != &other) {
      reset();
      swap(other);
    }
    return *this;
  }
  ~buffer() { reset(); }

  void *get() const noexcept { return ptr_; }
  template <typename T>
  T *as() const noexcept { return static_cast<T *>(ptr_); }
  std::size_t size() const noexcept { return size_; }
  gpupool_stream_t stream() const noexcept { return stream_; }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  // The block is also used by work queued on `other` (PyTorch's Tensor.record_stream).
  void record_stream(gpupool_stream_t other) { check(gpupool_record_stream(ptr_, other)); }

  // Frees the block now. A failure here can only be a gpupool bug; it is not thrown from a
  // destructor.
  void reset() noexcept {
    if (ptr_ != nullptr) gpupool_free(ptr_);
    ptr_ = nullptr;
    size_ = 0;
  }

 private:
  void swap(buffer &other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(size_, other.size_);
    std::swap(stream_, other.stream_);
  }
  void *ptr_ = nullptr;
  std::size_t size_ = 0;
  gpupool_stream_t stream_ = nullptr;
};

// Tags the blocks this thread allocates while it lives (gpupool_push_tag, and gpupool_pop_tag
// when destroyed): the innermost scope's name wins. Scopes nest on one thread; not movable, so
// that each pop matches its push.
class tag_scope {
 public:
  explicit tag_scope(const char *name) { check(gpupool_push_tag(name)); }
  explicit tag_scope(const std::string &name) : tag_scope(name.c_str()) {}
  tag_scope(const tag_scope &) = delete;
  tag_scope &operator=(const tag_scope &) = delete;
  // The pop cannot fail: this scope's push is on this thread's stack.
  ~tag_scope() { gpupool_pop_tag(); }
};

// A tag's statistics: bytes (rounded) and blocks, each current, peak, allocated and freed.
inline gpupool_tag_stats_t tag_stats(const char *name) {
  gpupool_tag_stats_t s{};
  check(gpupool_tag_stats(name, &s));
  return s;
}

// The live report of `device` (blocks grouped by tag and call stack, largest first).
inline std::string live_report(int device = -1) {
  std::string text;
  check(gpupool_live_report(
      device, [](const char *line, void *user) { static_cast<std::string *>(user)->append(line); }, &text));
  return text;
}

inline gpupool_stats_t stats(int device = -1) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  check(gpupool_stats(device, &s));
  return s;
}

// snprintf's idiom: ask for the size, then fill; gpupool writes `needed` even when the buffer
// is too small, so a table that grew between the calls (a new digit) is asked for again.
inline std::string summary(int device = -1) {
  std::size_t needed = 0;
  check(gpupool_memory_summary(device, nullptr, 0, &needed));
  std::string text;
  gpupool_status status;
  do {
    text.assign(needed, '\0');
    status = gpupool_memory_summary(device, text.data(), text.size(), &needed);
  } while (status == GPUPOOL_ERROR_INVALID_VALUE && needed > text.size());
  check(status);
  text.resize(needed - 1);
  return text;
}

inline void empty_cache(int device = -1) { check(gpupool_empty_cache(device)); }

}  // namespace gpupool
