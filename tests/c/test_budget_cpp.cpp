// gpupool::pool::set_limit and limit (examples/cpp/gpupool.hpp, issue 43) on the simulated
// device: a pool past its limit throws gpupool::error with OUT_OF_MEMORY, the message naming the
// pool and its limit, while another pool allocates; a limit over INT64_MAX and a released
// pool's new limit throw INVALID_VALUE and change nothing; the default pools' limit reads back
// in gpupool_stats.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gpupool.hpp"
#include "check.h"

int main() {
  const char *driver = std::getenv("GPUPOOL_DRIVER");
  if (driver == nullptr || std::strcmp(driver, "sim") != 0) {
    std::printf("test_budget_cpp: skipped (needs GPUPOOL_DRIVER=sim)\n");
    return 77;
  }
  const std::size_t mib = std::size_t(1) << 20;
  gpupool_stream_t s = reinterpret_cast<gpupool_stream_t>(0x30);
  gpupool::pool tenant(0), other(0);
  CHECK(tenant.limit() == GPUPOOL_NO_LIMIT);
  tenant.set_limit(32 * mib);
  CHECK(tenant.limit() == 32 * mib && tenant.stats().pool_limit == std::int64_t(32 * mib));
  try {
    tenant.set_limit(GPUPOOL_NO_LIMIT - 1);
    CHECK(false);
  } catch (const gpupool::error &e) {
    CHECK(e.status() == GPUPOOL_ERROR_INVALID_VALUE);
  }
  CHECK(tenant.limit() == 32 * mib);
  {
    gpupool::pool_scope route(tenant, s);
    gpupool::buffer a(20 * mib, s, 0);
    try {
      gpupool::buffer b(20 * mib, s, 0);
      CHECK(false);
    } catch (const gpupool::error &e) {
      CHECK(e.status() == GPUPOOL_ERROR_OUT_OF_MEMORY);
      CHECK(std::string(e.what()).find("limited to 32.00 MiB") != std::string::npos);
    }
  }
  {
    gpupool::pool_scope route(other, s);
    gpupool::buffer c(64 * mib, s, 0);
  }
  gpupool::set_default_pools_limit(0, 0);
  CHECK(gpupool::default_pools_limit(0) == 0 && gpupool::stats(0).pool_limit == 0);
  gpupool::set_default_pools_limit(0, GPUPOOL_NO_LIMIT);
  CHECK(gpupool::default_pools_limit(0) == GPUPOOL_NO_LIMIT);
  std::uint64_t id = tenant.id();
  tenant.release();
  CHECK(gpupool_pool_set_limit(0, id, mib) == GPUPOOL_ERROR_INVALID_VALUE);
  return checks_report("test_budget_cpp");
}
