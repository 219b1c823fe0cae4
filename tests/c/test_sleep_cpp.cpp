// gpupool::pool::sleep and wake (examples/cpp/gpupool.hpp) on the simulated device: a sleepable
// pool's buffer keeps its address and contents across offload, a second sleep throws
// gpupool::error with INVALID_VALUE, a pool not made sleepable refuses, the default pools sleep
// and wake through the free functions.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gpupool.hpp"
#include "check.h"

int main() {
  const char *driver = std::getenv("GPUPOOL_DRIVER");
  if (driver == nullptr || std::strcmp(driver, "sim") != 0) {
    std::printf("test_sleep_cpp: skipped (needs GPUPOOL_DRIVER=sim)\n");
    return 77;
  }
  const std::size_t n = std::size_t(5) << 20;
  gpupool::pool weights(0, gpupool::sleepable);
  gpupool_stream_t s = reinterpret_cast<gpupool_stream_t>(0x30);
  void *ptr = nullptr;
  {
    gpupool::buffer b;
    {
      // A route by stream is a capture's: the pool sleeps once it has ended.
      gpupool::pool_scope route(weights, s);
      b = gpupool::buffer(n, s, 0);
    }
    ptr = b.get();
    std::memset(ptr, 0x5a, n);
    weights.sleep(gpupool::sleep_mode::offload);
    CHECK(weights.stats().sleeping_bytes.current > 0);
    try {
      weights.sleep();
      CHECK(false);
    } catch (const gpupool::error &e) {
      CHECK(e.status() == GPUPOOL_ERROR_INVALID_VALUE);
    }
    weights.wake();
    CHECK(b.get() == ptr);
    std::vector<unsigned char> want(n, 0x5a);
    CHECK(std::memcmp(ptr, want.data(), n) == 0);
  }
  gpupool::pool plain(0);
  try {
    plain.sleep(gpupool::sleep_mode::discard);
    CHECK(false);
  } catch (const gpupool::error &e) {
    CHECK(e.status() == GPUPOOL_ERROR_INVALID_VALUE);
  }
  gpupool::sleep_default_pools(0, gpupool::sleep_mode::discard);
  gpupool::wake_default_pools(0);
  return checks_report("test_sleep_cpp");
}
