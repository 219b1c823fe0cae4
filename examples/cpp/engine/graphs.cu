// engine_graphs: the engine's network served eagerly, then replayed from CUDA graphs captured
// into a gpupool private pool, on the same stream of requests.
//
// Graph mode: batch sizes are bucketed (8, 24, 48 and 96 rows). One graph per bucket is
// captured on the compute stream with every allocation of that stream routed to one private
// pool (gpupool::pool_scope): the bucket's static input block is allocated before the capture,
// the activations during it (each freed once its reader is queued, so the capture reuses them,
// as an eager pass would), and the output block stays allocated for the replays. The four
// graphs share the pool: they replay one after another on one stream, so their activations may
// share addresses (PyTorch's `pool=` argument). A request of b rows is copied into the first b
// rows of its bucket's input, the graph replays, and the first b rows of its output are copied
// back; rows are independent, so they equal the CPU reference bit for bit.
//
// Eager mode: the same requests on the same stream, every activation a gpupool::buffer from the
// default pools, as engine.cu does (without its second stream).
//
// Then sleep: the graphs' private pool and the weights' pool (both made sleepable) are offloaded
// (gpupool_sleep), their device memory back to the driver (cudaMemGetInfo says by how much),
// woken at the same addresses, and the same graphs, not captured again, serve the requests
// again: every result equal, bit for bit, to the graphs' results before the sleep.
//
// Then a capture that fails on purpose (a cudaMalloc inside a global-mode capture): its
// private pool is released as the gpupool::pool object goes, and gpupool's reserved bytes and
// the device's free memory come back to the byte.
//
//   ./engine_graphs [requests [layers]]  (default 1000 requests of the engine's 4-layer network;
//                                          with layers, engine::deep_widths(layers): narrow
//                                          layers whose launches, not their work, bound eager mode)
// Exit status: 0 when every result matched and every check held, 1 otherwise, 77 when it cannot
// run here (no GPU, or GPUPOOL_DRIVER=sim).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common.cuh"
#include "gpupool.hpp"
#include "network.hpp"

namespace {

constexpr int buckets[] = {8, 24, 48, 96};
constexpr int depth = 4;  // requests in flight
constexpr int untimed = 50;  // requests served before the clock starts (warm caches)

int bucket_of(int batch) {
  for (int b : buckets) {
    if (batch <= b) return b;
  }
  throw std::runtime_error("batch of " + std::to_string(batch) + " rows is larger than the largest bucket");
}

// The forward pass over `rows` rows at `input`, queued on `stream`: each activation is a
// gpupool block allocated for `stream`, and the previous one is freed as soon as the kernel that
// reads it is queued (stream order makes that safe). Returns the output block.
gpupool::buffer forward(const std::vector<device_layer> &layers, const float *input, int rows, cudaStream_t stream) {
  gpupool::buffer x;
  for (std::size_t li = 0; li < layers.size(); li++) {
    const device_layer &l = layers[li];
    gpupool::buffer y(static_cast<std::size_t>(rows) * l.out * sizeof(float), stream);
    dim3 grid((l.out + 127) / 128, rows);
    dense<<<grid, 128, 0, stream>>>(l.weight.as<float>(), l.bias.as<float>(), li == 0 ? input : x.as<float>(),
                                     y.as<float>(), l.in, l.out, li + 1 < layers.size());
    CUDA(cudaGetLastError());
    x = std::move(y);
  }
  return x;
}

// One bucket's graph: the blocks it reads and writes keep their addresses across replays.
struct graph {
  int rows = 0;
  gpupool::buffer in, out;
  cudaGraphExec_t exec = nullptr;
};

// One request in flight.
struct slot {
  float *host_in = nullptr, *host_out = nullptr;
  cudaEvent_t done{};
  long long request = -1;
  int batch = 0;
};

const int in_width = engine::widths().front(), out_width = engine::widths().back();

// Serves `requests` requests through `enqueue` (which queues one request's copies and compute
// on the stream and records `s.done`), `depth` in flight; keeps every output in `results`.
// Returns requests per second over the requests after the first `untimed`.
double serve(long long requests, std::vector<slot> &slots, std::vector<std::vector<float>> &results,
             const std::function<void(slot &)> &enqueue) {
  std::vector<float> input;
  auto retire = [&](slot &s) {
    if (s.request < 0) return;
    CUDA(cudaEventSynchronize(s.done));
    results[s.request].assign(s.host_out, s.host_out + static_cast<std::size_t>(s.batch) * out_width);
    s.request = -1;
  };
  auto start = std::chrono::steady_clock::now();
  for (long long r = 0; r < requests; r++) {
    if (r == untimed) {
      for (auto &s : slots) retire(s);
      start = std::chrono::steady_clock::now();
    }
    slot &s = slots[r % depth];
    retire(s);
    s.request = r;
    s.batch = engine::batch_of(static_cast<std::uint64_t>(r));
    engine::make_input(static_cast<std::uint64_t>(r), s.batch, input);
    std::memcpy(s.host_in, input.data(), input.size() * sizeof(float));
    enqueue(s);
  }
  for (auto &s : slots) retire(s);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(requests - untimed) / seconds;
}

// Requests whose result differs from the CPU reference, eager and graph (the reference, far
// slower than the GPU, is computed once per request for both).
std::pair<long long, long long> mismatches(const std::vector<engine::layer> &net,
                                           const std::vector<std::vector<float>> &eager,
                                           const std::vector<std::vector<float>> &graphs) {
  long long bad[2] = {0, 0};
  std::vector<float> input;
  for (std::size_t r = 0; r < eager.size(); r++) {
    int batch = engine::batch_of(r);
    engine::make_input(r, batch, input);
    std::vector<float> want = engine::reference(net, input, batch);
    const std::vector<float> *got[2] = {&eager[r], &graphs[r]};
    for (int m = 0; m < 2; m++) {
      if (want.size() != got[m]->size() ||
          std::memcmp(want.data(), got[m]->data(), want.size() * sizeof(float)) != 0) {
        if (bad[m] < 5) {
          std::fprintf(stderr, "engine_graphs: %s: request %zu differs from the reference\n", m ? "graphs" : "eager", r);
        }
        bad[m]++;
      }
    }
  }
  return {bad[0], bad[1]};
}

double mib(long long bytes) { return static_cast<double>(bytes) / 1048576.0; }

}  // namespace

int main(int argc, char **argv) {
  long long requests = argc > 1 ? std::atoll(argv[1]) : 1000;
  int deep = argc > 2 ? std::atoi(argv[2]) : 0;
  if (requests <= untimed || argc > 3 || (argc > 2 && (deep < 2 || deep > 256))) {
    std::fprintf(stderr, "usage: engine_graphs [requests > %d [layers, 2 to 256]]\n", untimed);
    return 1;
  }
  const char *driver = std::getenv("GPUPOOL_DRIVER");
  if (driver != nullptr && std::strcmp(driver, "sim") == 0) {
    std::printf("engine_graphs: cannot run: GPUPOOL_DRIVER=sim gives host memory, and the kernels need device memory\n");
    return 77;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("engine_graphs: cannot run: no CUDA device here (cudaGetDeviceCount: %d devices)\n", devices);
    return 77;
  }

  try {
    const int device = 0;
    CUDA(cudaSetDevice(device));
    cudaStream_t compute;
    CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    const auto net = deep ? engine::make_network(42, engine::deep_widths(deep)) : engine::make_network(42);
    // The weights in a pool of their own that may sleep (declared first: it outlives them).
    gpupool::pool weights_pool(device, gpupool::sleepable);
    std::vector<device_layer> layers;
    {
      gpupool::pool_scope route(weights_pool, compute);
      layers = upload(net, compute);
    }
    const long long weights = gpupool::stats(device).allocated_bytes.all.current;

    std::vector<slot> slots(depth);
    for (auto &s : slots) {
      // Pinned staging buffers from gpupool's host cache, as engine.cu's.
      gpupool::check(gpupool_host_malloc(reinterpret_cast<void **>(&s.host_in), sizeof(float) * buckets[3] * in_width));
      gpupool::check(gpupool_host_malloc(reinterpret_cast<void **>(&s.host_out), sizeof(float) * buckets[3] * out_width));
      CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    }
    std::vector<std::vector<float>> eager_results(requests), graph_results(requests);

    // Eager.
    CUDA(cudaDeviceSynchronize());
    gpupool::check(gpupool_reset_peak_stats(device));
    double eager_rps = serve(requests, slots, eager_results, [&](slot &s) {
      gpupool::buffer x(static_cast<std::size_t>(s.batch) * in_width * sizeof(float), compute);
      CUDA(cudaMemcpyAsync(x.get(), s.host_in, x.size(), cudaMemcpyHostToDevice, compute));
      gpupool::buffer y = forward(layers, x.as<float>(), s.batch, compute);
      CUDA(cudaMemcpyAsync(s.host_out, y.get(), y.size(), cudaMemcpyDeviceToHost, compute));
      CUDA(cudaEventRecord(s.done, compute));
    });
    CUDA(cudaDeviceSynchronize());
    const long long eager_reserved = gpupool::stats(device).reserved_bytes.all.peak;
    gpupool::empty_cache(device);  // the default pools keep the weights' segments only

    // Graphs: the pool first, so that it outlives the graphs' blocks (destroyed in reverse);
    // sleepable, so that it can be offloaded with the graphs' buffers below.
    gpupool::pool pool(device, gpupool::sleepable);
    std::vector<graph> graphs;
    auto capture_start = std::chrono::steady_clock::now();
    {
      gpupool::pool_scope route(pool, compute);
      for (int rows : buckets) {
        graph g;
        g.rows = rows;
        g.in = gpupool::buffer(static_cast<std::size_t>(rows) * in_width * sizeof(float), compute);
        CUDA(cudaMemsetAsync(g.in.get(), 0, g.in.size(), compute));
        CUDA(cudaStreamSynchronize(compute));
        CUDA(cudaStreamBeginCapture(compute, cudaStreamCaptureModeGlobal));
        g.out = forward(layers, g.in.as<float>(), rows, compute);
        cudaGraph_t captured;
        CUDA(cudaStreamEndCapture(compute, &captured));
        CUDA(cudaGraphInstantiate(&g.exec, captured, 0));
        CUDA(cudaGraphDestroy(captured));
        graphs.push_back(std::move(g));
      }
    }
    double capture_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - capture_start).count();
    auto graph_of = [&](int batch) -> graph & {
      int rows = bucket_of(batch);
      for (auto &g : graphs) {
        if (g.rows == rows) return g;
      }
      throw std::runtime_error("no graph for " + std::to_string(rows) + " rows");
    };
    auto replay = [&](slot &s) {
      graph &g = graph_of(s.batch);
      CUDA(cudaMemcpyAsync(g.in.get(), s.host_in, static_cast<std::size_t>(s.batch) * in_width * sizeof(float),
                           cudaMemcpyHostToDevice, compute));
      CUDA(cudaGraphLaunch(g.exec, compute));
      CUDA(cudaMemcpyAsync(s.host_out, g.out.get(), static_cast<std::size_t>(s.batch) * out_width * sizeof(float),
                           cudaMemcpyDeviceToHost, compute));
      CUDA(cudaEventRecord(s.done, compute));
    };
    double graph_rps = serve(requests, slots, graph_results, replay);
    CUDA(cudaDeviceSynchronize());
    gpupool_stats_t ps = pool.stats();
    const long long graph_reserved = gpupool::stats(device).reserved_bytes.all.current;
    const auto [eager_bad, graph_bad] = mismatches(net, eager_results, graph_results);
    std::printf("engine_graphs: %lld requests (batch 1..%d), %d in flight, %zu layers: eager %lld of %lld results and "
                "graphs %lld of %lld match the CPU reference bit for bit\n",
                requests, buckets[3], depth, layers.size(), requests - eager_bad, requests, requests - graph_bad, requests);
    std::printf("engine_graphs: eager %.0f requests/s, %.2f MiB reserved at peak; graphs %.0f requests/s (%.2fx), "
                "%.2f MiB reserved, of which the private pool of the %zu graphs (captured in %.1f ms) %.2f MiB "
                "(%.2f MiB allocated: static inputs and outputs); weights %.2f MiB in both\n",
                eager_rps, mib(eager_reserved), graph_rps, graph_rps / eager_rps, mib(graph_reserved), graphs.size(),
                capture_ms, mib(ps.reserved_bytes.all.current), mib(ps.allocated_bytes.all.current), mib(weights));
    bool ok = eager_bad == 0 && graph_bad == 0;

    // Sleep: both pools offloaded, their memory back to the driver; woken, the same graphs
    // replay (no capture) and every result is the same, bit for bit.
    CUDA(cudaDeviceSynchronize());
    size_t free_awake = 0, free_asleep = 0, free_woken = 0, total_memory = 0;
    CUDA(cudaMemGetInfo(&free_awake, &total_memory));
    const long long pools_reserved =
        pool.stats().reserved_bytes.all.current + weights_pool.stats().reserved_bytes.all.current;
    auto sleep_start = std::chrono::steady_clock::now();
    pool.sleep(gpupool::sleep_mode::offload);
    weights_pool.sleep(gpupool::sleep_mode::offload);
    double sleep_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - sleep_start).count();
    CUDA(cudaMemGetInfo(&free_asleep, &total_memory));
    const long long sleeping = gpupool::stats(device).sleeping_bytes.current;
    auto wake_start = std::chrono::steady_clock::now();
    weights_pool.wake();
    pool.wake();
    double wake_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wake_start).count();
    CUDA(cudaMemGetInfo(&free_woken, &total_memory));
    std::vector<std::vector<float>> woken_results(requests);
    serve(requests, slots, woken_results, replay);
    long long woken_bad = 0;
    for (long long r = 0; r < requests; r++) {
      const auto &was = graph_results[r], &now = woken_results[r];
      woken_bad += was.size() != now.size() || std::memcmp(was.data(), now.data(), was.size() * sizeof(float)) != 0;
    }
    const long long rose = static_cast<long long>(free_asleep) - static_cast<long long>(free_awake);
    bool slept_ok = woken_bad == 0 && sleeping == pools_reserved && rose >= pools_reserved;
    const long long fell = static_cast<long long>(free_asleep) - static_cast<long long>(free_woken);
    std::printf("engine_graphs: slept the graphs' pool and the weights (offload, %.1f ms): %.2f MiB sleeping, device "
                "free memory up %.2f MiB; woken (%.1f ms, device free memory down %.2f MiB again), the %zu graphs "
                "replayed without capturing again: %lld of %lld results equal to before the sleep bit for bit: %s\n",
                sleep_ms, mib(sleeping), mib(rose), wake_ms, mib(fell), graphs.size(), requests - woken_bad, requests,
                slept_ok ? "ok" : "FAILED");
    ok = ok && slept_ok;

    for (auto &g : graphs) CUDA(cudaGraphExecDestroy(g.exec));
    graphs.clear();
    pool.release();
    gpupool::empty_cache(device);

    // A capture that fails: its pool goes back to the byte.
    CUDA(cudaDeviceSynchronize());
    size_t free_before = 0, free_after = 0, total = 0;
    CUDA(cudaMemGetInfo(&free_before, &total));
    const long long reserved_before = gpupool::stats(device).reserved_bytes.all.current;
    long long doomed_reserved = 0;
    cudaError_t end_status = cudaSuccess, malloc_status = cudaSuccess;
    {
      gpupool::pool doomed(device);
      gpupool::pool_scope route(doomed, compute);
      CUDA(cudaStreamBeginCapture(compute, cudaStreamCaptureModeGlobal));
      gpupool::buffer x(static_cast<std::size_t>(buckets[3]) * in_width * sizeof(float), compute);
      doomed_reserved = doomed.stats().reserved_bytes.all.current;
      void *stray = nullptr;
      malloc_status = cudaMalloc(&stray, 1 << 20);  // not allowed while a global-mode capture runs
      if (malloc_status == cudaSuccess) cudaFree(stray);
      cudaGraph_t captured = nullptr;
      end_status = cudaStreamEndCapture(compute, &captured);
      if (captured != nullptr) cudaGraphDestroy(captured);
      (void)cudaGetLastError();
      // x, the route and the pool go here, in that order.
    }
    CUDA(cudaDeviceSynchronize());
    CUDA(cudaMemGetInfo(&free_after, &total));
    const long long reserved_after = gpupool::stats(device).reserved_bytes.all.current;
    bool failed_ok = end_status != cudaSuccess && doomed_reserved > 0 && reserved_after == reserved_before &&
                     free_after == free_before;
    std::printf("engine_graphs: a failed capture (cudaMalloc: %s; cudaStreamEndCapture: %s) had %.2f MiB in its "
                "private pool; after the pool went: gpupool reserved %lld bytes (before %lld), device free %zu "
                "bytes (before %zu): %s\n",
                cudaGetErrorName(malloc_status), cudaGetErrorName(end_status), mib(doomed_reserved), reserved_after,
                reserved_before, free_after, free_before, failed_ok ? "given back" : "NOT given back");
    ok = ok && failed_ok;

    layers.clear();
    weights_pool.release();
    for (auto &s : slots) {
      gpupool::check(gpupool_host_free(s.host_in));
      gpupool::check(gpupool_host_free(s.host_out));
      CUDA(cudaEventDestroy(s.done));
    }
    CUDA(cudaDeviceSynchronize());
    gpupool::empty_cache(device);
    gpupool_stats_t st = gpupool::stats(device);
    ok = ok && st.reserved_bytes.all.current == 0 && st.allocated_bytes.all.current == 0;
    std::printf("engine_graphs: after empty_cache: %lld bytes reserved, %lld allocated\n",
                static_cast<long long>(st.reserved_bytes.all.current),
                static_cast<long long>(st.allocated_bytes.all.current));
    CUDA(cudaStreamDestroy(compute));
    std::printf("engine_graphs: %s\n", ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "engine_graphs: %s\n", e.what());
    return 1;
  }
}
