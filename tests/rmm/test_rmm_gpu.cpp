// gpupool::rmm_resource on a GPU, as RMM code uses it: gpupool becomes RMM's current device
// resource, rmm::device_buffer allocates on real streams, the bytes copied in come back out,
// gpupool's statistics count the buffers while they live, a buffer freed on its stream is
// reused there, and a buffer freed on another stream is reused once that stream is done.
// scripts/gpu.sh's plugins section builds it against the librmm wheel and runs it with
// GPUPOOL_DRIVER=cuda; scripts/test.sh builds it (no GPU there: it is not run).
//
// Prints one line per check and "N passed, N failed"; exits 1 when a check failed, 2 when
// CUDA is not usable.
#include <gpupool_rmm.hpp>

#include <cuda_runtime_api.h>
#include <rmm/device_buffer.hpp>
#include <rmm/mr/per_device_resource.hpp>

#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

static int passed = 0, failed = 0;

static void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  ok ? ++passed : ++failed;
}

static int64_t allocated(int device) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  gpupool_stats(device, &s);
  return s.allocated_bytes.all.current;
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 2;
  }
  constexpr std::size_t MiB = 1 << 20;
  cudaStream_t a = nullptr, b = nullptr;
  cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  rmm::mr::set_current_device_resource(gpupool::rmm_resource{});

  const int64_t base = allocated(0);
  std::vector<unsigned char> in(8 * MiB), out(8 * MiB, 0);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned char>(i * 131 + 7);
  void* first = nullptr;
  {
    rmm::device_buffer buf(in.data(), in.size(), cuda::stream_ref{a});  // copies in on stream a
    first = buf.data();
    check(allocated(0) == base + static_cast<int64_t>(8 * MiB), "rmm::device_buffer's 8 MiB in gpupool's statistics");
    cudaMemcpyAsync(out.data(), buf.data(), out.size(), cudaMemcpyDeviceToHost, a);
    cudaStreamSynchronize(a);
    check(std::memcmp(in.data(), out.data(), in.size()) == 0, "the bytes copied in come back out");
  }  // freed on stream a
  check(allocated(0) == base, "the buffer's destructor gives it back to gpupool");
  {
    rmm::device_buffer again(8 * MiB, cuda::stream_ref{a});
    check(again.data() == first, "a buffer freed on stream a is reused on stream a");
    rmm::device_buffer other(8 * MiB, cuda::stream_ref{b});
    check(other.data() != first, "and not on stream b");
    // Freed on stream b instead (the buffer's stream set to b): reused on a once b is done.
    again.set_stream(cuda::stream_ref{b});
  }
  cudaStreamSynchronize(b);
  {
    rmm::device_buffer later(8 * MiB, cuda::stream_ref{a});
    check(later.data() == first, "a buffer freed on stream b comes back to stream a once b's work is done");
  }
  // More than the GPU has (not an absurd size, which address reservation would refuse first).
  std::size_t free_bytes = 0, total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  bool oom = false;
  try {
    rmm::device_buffer huge(total_bytes + (std::size_t{1} << 30), cuda::stream_ref{a});
  } catch (rmm::out_of_memory const& e) {
    oom = true;
    std::printf("  (%s)\n", e.what());
  } catch (std::exception const& e) {
    std::printf("  not rmm::out_of_memory: %s\n", e.what());
  }
  check(oom, "a request larger than the GPU throws rmm::out_of_memory");
  cudaStreamSynchronize(a);
  rmm::mr::reset_current_device_resource();
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
