// engine: what an inference engine asks of its allocator, on a real GPU.
//
// It serves a stream of requests of varying batch sizes with a multi-layer network
// (network.hpp). Each request's input is copied host-to-device on a copy stream; the layers run
// on a compute stream; the result is copied back on the copy stream. Every device buffer is a
// gpupool::buffer (gpupool.hpp), freed as soon as the host is done enqueuing work on it, and
// record_stream tells gpupool about the other stream: the input block is allocated on the copy
// stream and read by compute, the output block is allocated on compute and read by the copy.
// Up to `depth` requests are in flight at once.
//
// Between bursts of `burst` requests the engine sleeps, as one sharing its GPU with another
// model or phase would: the weights, in a pool of their own made sleepable, are offloaded
// (gpupool_sleep, their contents to host memory) and the default pools (inputs and activations,
// all free by then: cache) are discarded; the device's free memory rises by both pools' reserved
// bytes (cudaMemGetInfo); then both wake at the same addresses and the next burst runs on the
// restored weights.
//
// Every result is compared bit for bit with the CPU reference, after the timed run (the CPU
// reference is far slower than the GPU). A block that gpupool handed out again before the other
// stream had finished with it would be overwritten while still in use, and the comparison
// would catch it.
//
//   ./engine [requests] [depth] [snapshot.pickle|-] [burst]
//                                      (defaults: 400 requests, 4 in flight, no snapshot, a sleep
//                                      after every 100 requests; burst 0: never sleep)
// Exit status: 0 when every result matched, 1 on a mismatch or an error, 77 when it cannot run
// here (no GPU, or GPUPOOL_DRIVER=sim).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"
#include "gpupool.hpp"
#include "network.hpp"

namespace {

// One request in flight: its pinned host buffers and the events that order its streams.
struct slot {
  float *host_in = nullptr, *host_out = nullptr;
  cudaEvent_t uploaded{}, computed{}, done{};
  long long request = -1;
  int batch = 0;
};

constexpr int max_batch = 96;

}  // namespace

int main(int argc, char **argv) {
  long long requests = argc > 1 ? std::atoll(argv[1]) : 400;
  int depth = argc > 2 ? std::atoi(argv[2]) : 4;
  // Where to write gpupool's snapshot after the run (PyTorch's pickle: the history must be on,
  // e.g. GPUPOOL_RECORD_HISTORY=100000:alloc, for its trace and stacks).
  const char *snapshot = argc > 3 && std::strcmp(argv[3], "-") != 0 ? argv[3] : nullptr;
  long long burst = argc > 4 ? std::atoll(argv[4]) : 100;
  if (requests < 1 || depth < 1 || burst < 0) {
    std::fprintf(stderr, "usage: engine [requests >= 1] [depth >= 1] [snapshot.pickle|-] [burst >= 0]\n");
    return 1;
  }
  const char *driver = std::getenv("GPUPOOL_DRIVER");
  if (driver != nullptr && std::strcmp(driver, "sim") == 0) {
    std::printf("engine: cannot run: GPUPOOL_DRIVER=sim gives host memory, and the kernels need device memory\n");
    return 77;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("engine: cannot run: no CUDA device here (cudaGetDeviceCount: %d devices)\n", devices);
    return 77;
  }

  try {
    CUDA(cudaSetDevice(0));
    cudaStream_t copy, compute;
    CUDA(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
    CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));

    // The weights live for the whole run, allocated on the compute stream that reads them.
    const auto net = engine::make_network(42);
    // Each stage's blocks carry a tag (gpupool::tag_scope): per-tag statistics, the snapshot and
    // the live report say which stage holds what.
    // The weights' pool may sleep (declared before the weights: it outlives them).
    gpupool::pool weights_pool(0, gpupool::sleepable);
    std::vector<device_layer> layers;
    {
      gpupool::tag_scope tag("weights");
      gpupool::pool_scope route(weights_pool, compute);
      layers = upload(net, compute);
    }
    const int in_width = engine::widths().front(), out_width = engine::widths().back();

    std::vector<slot> slots(depth);
    for (auto &s : slots) {
      // Staging buffers are pinned host blocks from gpupool's cache (gpupool_host_malloc): the
      // copies through them are asynchronous, and a later engine reuses the pinned memory
      // instead of paying cudaMallocHost's milliseconds again.
      gpupool::check(gpupool_host_malloc(reinterpret_cast<void **>(&s.host_in), sizeof(float) * max_batch * in_width));
      gpupool::check(gpupool_host_malloc(reinterpret_cast<void **>(&s.host_out), sizeof(float) * max_batch * out_width));
      CUDA(cudaEventCreateWithFlags(&s.uploaded, cudaEventDisableTiming));
      CUDA(cudaEventCreateWithFlags(&s.computed, cudaEventDisableTiming));
      CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }

    long long checked = 0, mismatched = 0, rows = 0;
    std::vector<float> input;
    std::vector<std::vector<float>> results(static_cast<std::size_t>(requests));
    // Waits for the request in `s` and keeps its output.
    auto retire = [&](slot &s) {
      if (s.request < 0) return;
      CUDA(cudaEventSynchronize(s.done));
      results[s.request].assign(s.host_out, s.host_out + static_cast<std::size_t>(s.batch) * out_width);
      s.request = -1;
    };

    std::vector<std::string> layer_tags;
    for (std::size_t li = 0; li < layers.size(); li++) layer_tags.push_back("layer " + std::to_string(li));

    // Sleeps between two bursts: every request retired, the weights offloaded and the default
    // pools discarded; the device's free memory checked; both woken.
    long long sleeps = 0, slept_ok = 0;
    double sleep_ms = 0, wake_ms = 0, freed_mib = 0, paused_s = 0;
    auto sleep_between_bursts = [&]() {
      auto paused = std::chrono::steady_clock::now();
      for (auto &s : slots) retire(s);
      size_t free_awake = 0, free_asleep = 0, total = 0;
      CUDA(cudaMemGetInfo(&free_awake, &total));
      const long long reserved = gpupool::stats().reserved_bytes.all.current;
      auto t = std::chrono::steady_clock::now();
      weights_pool.sleep(gpupool::sleep_mode::offload);
      gpupool::sleep_default_pools(0, gpupool::sleep_mode::discard);
      sleep_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      CUDA(cudaMemGetInfo(&free_asleep, &total));
      const long long sleeping = gpupool::stats().sleeping_bytes.current;
      const long long rose = static_cast<long long>(free_asleep) - static_cast<long long>(free_awake);
      t = std::chrono::steady_clock::now();
      gpupool::wake_default_pools(0);
      weights_pool.wake();
      wake_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      freed_mib += rose / 1048576.0;
      sleeps++;
      // Every page of both pools went back: the device's free memory rose by their reserved bytes.
      if (sleeping == reserved && rose >= reserved) {
        slept_ok++;
      } else {
        std::fprintf(stderr, "engine: sleep %lld: %lld bytes reserved, %lld sleeping, device free memory up %lld\n",
                     sleeps, reserved, sleeping, rose);
      }
      // The requests per second count serving only.
      paused_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - paused).count();
    };

    long long device_allocs_warm = -1;
    auto start = std::chrono::steady_clock::now();
    for (long long r = 0; r < requests; r++) {
      if (burst > 0 && r > 0 && r % burst == 0) sleep_between_bursts();
      slot &s = slots[r % depth];
      retire(s);
      s.request = r;
      s.batch = engine::batch_of(static_cast<std::uint64_t>(r));
      rows += s.batch;
      engine::make_input(static_cast<std::uint64_t>(r), s.batch, input);
      std::memcpy(s.host_in, input.data(), input.size() * sizeof(float));

      // Input: allocated for the copy stream, read by compute.
      gpupool::buffer x;
      {
        gpupool::tag_scope tag("input");
        x = gpupool::buffer(input.size() * sizeof(float), copy);
      }
      CUDA(cudaMemcpyAsync(x.get(), s.host_in, x.size(), cudaMemcpyHostToDevice, copy));
      CUDA(cudaEventRecord(s.uploaded, copy));
      CUDA(cudaStreamWaitEvent(compute, s.uploaded, 0));
      x.record_stream(compute);

      // Layers: each activation is allocated on compute; the previous one is freed as soon as
      // the kernel that reads it is queued (stream order makes that safe on compute itself).
      for (std::size_t li = 0; li < layers.size(); li++) {
        const device_layer &l = layers[li];
        gpupool::tag_scope tag(layer_tags[li]);
        gpupool::buffer y(static_cast<std::size_t>(s.batch) * l.out * sizeof(float), compute);
        dim3 grid((l.out + 127) / 128, s.batch);
        dense<<<grid, 128, 0, compute>>>(l.weight.as<float>(), l.bias.as<float>(), x.as<float>(), y.as<float>(),
                                         l.in, l.out, li + 1 < layers.size());
        CUDA(cudaGetLastError());
        x = std::move(y);  // frees the previous block
      }

      // Output: allocated on compute, read by the copy stream.
      CUDA(cudaEventRecord(s.computed, compute));
      CUDA(cudaStreamWaitEvent(copy, s.computed, 0));
      x.record_stream(copy);
      CUDA(cudaMemcpyAsync(s.host_out, x.get(), x.size(), cudaMemcpyDeviceToHost, copy));
      CUDA(cudaEventRecord(s.done, copy));
      // x is freed here, while its copy may still be running: gpupool keeps the block until
      // the copy stream has passed this point.
      if (r + 1 == std::min<long long>(requests, 50)) device_allocs_warm = gpupool::stats().num_device_alloc;
    }
    for (auto &s : slots) retire(s);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - paused_s;

    for (long long r = 0; r < requests; r++) {
      int batch = engine::batch_of(static_cast<std::uint64_t>(r));
      engine::make_input(static_cast<std::uint64_t>(r), batch, input);
      std::vector<float> want = engine::reference(net, input, batch);
      if (want.size() != results[r].size() ||
          std::memcmp(want.data(), results[r].data(), want.size() * sizeof(float)) != 0) {
        if (mismatched < 5) std::fprintf(stderr, "engine: request %lld differs from the reference\n", r);
        mismatched++;
      }
      checked++;
    }

    gpupool_stats_t st = gpupool::stats();
    std::printf("engine: %lld requests (%lld rows, batch 1..%d), %d in flight, %d layers: %lld of %lld results "
                "match the CPU reference bit for bit\n",
                requests, rows, max_batch, depth, static_cast<int>(layers.size()), checked - mismatched, checked);
    std::printf("engine: %.0f requests/s served (checking and sleeps excluded); gpupool: %lld allocations, peak %lld live blocks, peak %.1f MiB allocated, "
                "peak %.1f MiB reserved, %lld device allocations (%lld after the first 50 requests), %lld retries\n",
                requests / seconds, static_cast<long long>(st.allocation.all.allocated),
                static_cast<long long>(st.allocation.all.peak), st.allocated_bytes.all.peak / 1048576.0,
                st.reserved_bytes.all.peak / 1048576.0, static_cast<long long>(st.num_device_alloc),
                static_cast<long long>(st.num_device_alloc - device_allocs_warm),
                static_cast<long long>(st.num_alloc_retries));
    long long expected_live = 2 * static_cast<long long>(layers.size());
    if (sleeps > 0) {
      std::printf("engine: slept %lld times between bursts of %lld requests (weights offloaded, default pools "
                  "discarded): device free memory up %.1f MiB each on average, sleep %.1f ms, wake %.1f ms on "
                  "average; %lld of %lld sleeps gave back every reserved byte\n",
                  sleeps, burst, freed_mib / sleeps, sleep_ms / sleeps, wake_ms / sleeps, slept_ok, sleeps);
    }
    std::printf("engine: peak MiB allocated per tag:");
    std::vector<std::string> tags = {"weights", "input"};
    tags.insert(tags.end(), layer_tags.begin(), layer_tags.end());
    for (const auto &t : tags) std::printf(" %s %.2f;", t.c_str(), gpupool::tag_stats(t.c_str()).bytes.peak / 1048576.0);
    std::printf("\n");
    // Every live block is a weight, and every weight is tagged.
    gpupool_tag_stats_t weights = gpupool::tag_stats("weights");
    bool ok = mismatched == 0 && st.allocation.all.current == expected_live && weights.blocks.current == expected_live &&
              weights.bytes.current == st.allocated_bytes.all.current && slept_ok == sleeps;
    if (snapshot != nullptr) {
      if (gpupool_dump_snapshot(snapshot) == GPUPOOL_SUCCESS) {
        std::printf("engine: snapshot in %s\n", snapshot);
      } else {
        std::fprintf(stderr, "engine: gpupool_dump_snapshot: %s\n", gpupool_last_error_message());
        ok = false;
      }
    }
    if (st.allocation.all.current != expected_live) {
      std::fprintf(stderr, "engine: %lld live blocks after the run, expected %lld (the weights)\n",
                   static_cast<long long>(st.allocation.all.current), expected_live);
    }

    layers.clear();
    weights_pool.release();
    for (auto &s : slots) {
      // The copy stream may still read or write them: gpupool reuses them only after it passed.
      gpupool::check(gpupool_host_record_event(s.host_in, copy));
      gpupool::check(gpupool_host_record_event(s.host_out, copy));
      gpupool::check(gpupool_host_free(s.host_in));
      gpupool::check(gpupool_host_free(s.host_out));
      CUDA(cudaEventDestroy(s.uploaded));
      CUDA(cudaEventDestroy(s.computed));
      CUDA(cudaEventDestroy(s.done));
    }
    CUDA(cudaDeviceSynchronize());
    gpupool::empty_cache();
    st = gpupool::stats();
    std::printf("engine: after empty_cache: %lld bytes reserved, %lld allocated\n",
                static_cast<long long>(st.reserved_bytes.all.current),
                static_cast<long long>(st.allocated_bytes.all.current));
    ok = ok && st.reserved_bytes.all.current == 0 && st.allocated_bytes.all.current == 0;
    CUDA(cudaStreamDestroy(copy));
    CUDA(cudaStreamDestroy(compute));
    std::printf("engine: %s\n", ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "engine: %s\n", e.what());
    return 1;
  }
}
