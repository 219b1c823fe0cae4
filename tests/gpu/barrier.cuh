// A spinning barrier for the GPU tests that start their threads' steps together (test_two_gpus,
// test_sleep_all), so that sleeps, wakes and copies on several devices overlap.
#ifndef GPUPOOL_TEST_BARRIER_CUH
#define GPUPOOL_TEST_BARRIER_CUH

#include <atomic>
#include <thread>

// `n` threads call wait(); each returns once all have called it. Reusable: the generation
// moves on each time the last one arrives.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    int gen = gen_.load();
    if (count_.fetch_add(1) + 1 == n_) {
      count_.store(0);
      gen_.fetch_add(1);
    } else {
      while (gen_.load() == gen) std::this_thread::yield();
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0}, gen_{0};
};

#endif
