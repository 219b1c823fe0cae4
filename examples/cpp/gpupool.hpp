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
//   gpupool::pool graphs(device);                    // a private pool (CUDA graphs)
//   { gpupool::pool_scope route(graphs, stream);     // this stream's allocations go to it
//     ... capture ... }                              // until the scope ends
//   // ~pool: gpupool_release_pool; a capture that threw on the way releases it too
//
//   gpupool::pool spare(device, GPUPOOL_POOL_USE_ON_OOM);  // serves the default pools on OOM
//   gpupool::pool weights(device, gpupool::sleepable);  // a pool that may sleep
//   weights.sleep(gpupool::sleep_mode::offload);      // its memory back to the driver
//   weights.wake();                                   // at the same addresses, contents kept
//
// Errors become gpupool::error (a std::runtime_error with the status and gpupool's message).
// A buffer owns its block alone (move-only, like std::unique_ptr) and frees it when destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
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

// Makes the memory gpupool maps on `peer` reachable from `device` (gpupool_enable_peer_access;
// PyTorch's enablePeerAccess(dev, dev_to_access)): pages mapped now and from now on.
inline void enable_peer_access(int device, int peer) { check(gpupool_enable_peer_access(device, peer)); }

// A private pool on one device (PyTorch's graph pool, `torch.cuda.graph_pool_handle()`): memory
// for CUDA graphs, whose blocks keep their addresses for as long as the graphs replay. The pool
// is released when the object is destroyed (gpupool_release_pool): destroy it after the graphs
// that use its memory (or destroy them first), and a capture that fails on the way, by
// exception or by an early return, gives the pool's memory back instead of leaking it.
// Move-only.
// What gpupool::pool::sleep does with the contents of the pool's live blocks.
enum class sleep_mode : std::uint32_t {
  offload = GPUPOOL_SLEEP_OFFLOAD,  // copied to host memory, back at wake (weights)
  discard = GPUPOOL_SLEEP_DISCARD,  // dropped (KV cache, activations)
  // copied to pinned host memory the pool keeps after wake: later sleeps copy at the bus's speed
  offload_pinned = GPUPOOL_SLEEP_OFFLOAD_PINNED,
};

// Tag for a pool that may sleep (gpupool_pool_create_sleepable).
struct sleepable_t {
  explicit sleepable_t() = default;
};
inline constexpr sleepable_t sleepable{};

// Sleep and wake of `device`'s default pools (pool 0: gpupool_sleep, gpupool_wake).
inline void sleep_default_pools(int device, sleep_mode mode) {
  check(gpupool_sleep(device, 0, static_cast<std::uint32_t>(mode)));
}
inline void wake_default_pools(int device) { check(gpupool_wake(device, 0)); }
// The host memory of a later sleep_default_pools(device, mode) made ready now
// (gpupool_sleep_prepare): returns the pinned bytes held for it while the pools are awake.
inline std::size_t prepare_default_pools_sleep(int device, sleep_mode mode) {
  std::size_t pinned = 0;
  check(gpupool_sleep_prepare(device, 0, static_cast<std::uint32_t>(mode), &pinned));
  return pinned;
}

// The limit of `device`'s default pools (pool 0, every stream's together: gpupool_pool_set_limit
// and gpupool_pool_get_limit); GPUPOOL_NO_LIMIT for none.
inline void set_default_pools_limit(int device, std::uint64_t bytes) {
  check(gpupool_pool_set_limit(device, 0, bytes));
}
inline std::uint64_t default_pools_limit(int device) {
  std::uint64_t bytes = 0;
  check(gpupool_pool_get_limit(device, 0, &bytes));
  return bytes;
}

class pool {
 public:
  explicit pool(int device) : device_(device) { check(gpupool_pool_create(&id_)); }
  // A pool whose memory is on CUDA's virtual memory API, so that it may sleep.
  pool(int device, sleepable_t) : device_(device) { check(gpupool_pool_create_sleepable(&id_)); }
  // A pool with flags (gpupool_pool_create_ex; PyTorch MemPool(use_on_oom=, no_split=)):
  // GPUPOOL_POOL_USE_ON_OOM, its cache serves the default pools' requests that would fail with
  // out of memory; GPUPOOL_POOL_NO_SPLIT, it never splits a block. Throws INVALID_VALUE for a
  // bit that is no flag.
  pool(int device, std::uint32_t flags) : device_(device) { check(gpupool_pool_create_ex(&id_, flags)); }
  pool(const pool &) = delete;
  pool &operator=(const pool &) = delete;
  pool(pool &&other) noexcept : device_(other.device_), id_(std::exchange(other.id_, 0)) {}
  pool &operator=(pool &&other) noexcept {
    if (this != &other) {
      release();
      device_ = other.device_;
      id_ = std::exchange(other.id_, 0);
    }
    return *this;
  }
  ~pool() { release(); }

  std::uint64_t id() const noexcept { return id_; }
  int device() const noexcept { return device_; }

  // The pool's statistics (bytes and blocks, as gpupool_stats).
  gpupool_stats_t stats() const {
    gpupool_stats_t s = GPUPOOL_STATS_INIT;
    check(gpupool_pool_stats(device_, id_, &s));
    return s;
  }

  // Caps the bytes the pool may reserve on its device (gpupool_pool_set_limit); past it, an
  // allocation of the pool releases the pool's own free cache, then throws gpupool::error
  // (OUT_OF_MEMORY, naming the pool, its limit and its use); other pools are not touched.
  // GPUPOOL_NO_LIMIT removes the limit. Throws INVALID_VALUE for a released pool or a limit
  // over INT64_MAX (but GPUPOOL_NO_LIMIT).
  void set_limit(std::uint64_t bytes) const { check(gpupool_pool_set_limit(device_, id_, bytes)); }

  // The pool's limit in bytes, GPUPOOL_NO_LIMIT for none (gpupool_pool_get_limit).
  std::uint64_t limit() const {
    std::uint64_t bytes = 0;
    check(gpupool_pool_get_limit(device_, id_, &bytes));
    return bytes;
  }

  // Gives the pool's memory back to the driver, keeping its blocks' addresses
  // (gpupool_sleep); nothing is allocated from it until wake(). Throws gpupool::error
  // (INVALID_VALUE for a pool not made sleepable, or asleep already).
  void sleep(sleep_mode mode = sleep_mode::offload) const {
    check(gpupool_sleep(device_, id_, static_cast<std::uint32_t>(mode)));
  }

  // Makes the host memory of a later sleep(mode) ready now, so that the first sleep runs as
  // fast as the next ones (gpupool_sleep_prepare): with offload_pinned, a pinned copy of the
  // pool's live bytes, held while it is awake. Returns the pinned bytes held for the sleep.
  // Throws gpupool::error (INVALID_VALUE for a pool that cannot sleep or sleeps; OUT_OF_MEMORY
  // when the host cannot pin the copy), the pool as it was.
  std::size_t sleep_prepare(sleep_mode mode = sleep_mode::offload_pinned) const {
    std::size_t pinned = 0;
    check(gpupool_sleep_prepare(device_, id_, static_cast<std::uint32_t>(mode), &pinned));
    return pinned;
  }

  // Maps memory back at the same addresses and restores offloaded contents (gpupool_wake).
  // Throws gpupool::error (OUT_OF_MEMORY: the pool still sleeps, its host copy intact).
  void wake() const { check(gpupool_wake(device_, id_)); }

  // Gives the pool's memory back now (its free segments at once, the rest as blocks are freed).
  // A failure here can only be a gpupool bug; it is not thrown from a destructor.
  void release() noexcept {
    if (id_ != 0) gpupool_release_pool(device_, id_);
    id_ = 0;
  }

 private:
  int device_;
  std::uint64_t id_ = 0;
};

// Routes the allocations made on (pool's device, stream) to `p` while it lives
// (gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool when destroyed): what a
// capture on `stream` allocates comes from the private pool. Not movable, so that each end
// matches its begin.
class pool_scope {
 public:
  pool_scope(const pool &p, gpupool_stream_t stream) : device_(p.device()), id_(p.id()) {
    check(gpupool_begin_allocate_to_pool(device_, id_, stream));
  }
  pool_scope(const pool_scope &) = delete;
  pool_scope &operator=(const pool_scope &) = delete;
  ~pool_scope() { gpupool_end_allocate_to_pool(device_, id_); }

 private:
  int device_;
  std::uint64_t id_;
};

}  // namespace gpupool
