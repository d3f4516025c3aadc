// How far apart two CPUs are, as the decode step's threads feel it: two threads, pinned to the two
// CPUs, pass one cache line back and forth, and a round trip's time is returned. Within one core
// (SMT siblings) it is ~30 ns, between cores sharing an L3 ~70 ns, across L3s (chiplets or
// sockets) several times that. Built by bench/cpu_placement.py through optkit's cpp_build.
#include <torch/library.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

bool pin_to(int64_t cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>(cpu), &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

struct alignas(64) Line {
  std::atomic<int64_t> value{0};
};

// The median over `batches` of the mean round trip (ns) of `rounds` passes each, between CPUs a and b;
// -1 where a thread cannot be pinned to its CPU.
double core_round_trip_ns(int64_t cpu_a, int64_t cpu_b, int64_t rounds, int64_t batches) {
  TORCH_CHECK_VALUE(rounds >= 1 && batches >= 1 && cpu_a >= 0 && cpu_b >= 0 && cpu_a < CPU_SETSIZE &&
                        cpu_b < CPU_SETSIZE,
                    "core_round_trip_ns: two CPUs, rounds and batches at least 1");
  Line line;
  std::atomic<bool> pinned{true};
  std::vector<double> means;
  std::thread partner([&] {
    if (!pin_to(cpu_b)) pinned = false;
    for (int64_t i = 0; i < rounds * batches; ++i) {  // answers each odd value with the next even one
      while (line.value.load(std::memory_order_acquire) != 2 * i + 1) {
        if (!pinned.load(std::memory_order_relaxed)) return;
      }
      line.value.store(2 * i + 2, std::memory_order_release);
    }
  });
  cpu_set_t before;
  pthread_getaffinity_np(pthread_self(), sizeof(before), &before);
  if (!pin_to(cpu_a)) pinned = false;
  for (int64_t batch = 0; batch < batches && pinned.load(); ++batch) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = batch * rounds; i < (batch + 1) * rounds && pinned.load(std::memory_order_relaxed); ++i) {
      line.value.store(2 * i + 1, std::memory_order_release);
      while (line.value.load(std::memory_order_acquire) != 2 * i + 2) {
        if (!pinned.load(std::memory_order_relaxed)) break;
      }
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    means.push_back(took.count() / static_cast<double>(rounds));
  }
  pinned = pinned.load() && static_cast<int64_t>(means.size()) == batches;  // else the partner stops waiting
  partner.join();
  pthread_setaffinity_np(pthread_self(), sizeof(before), &before);  // the caller's CPUs back
  if (!pinned) return -1.0;
  std::nth_element(means.begin(), means.begin() + batches / 2, means.end());
  return means[batches / 2];
}

}  // namespace

TORCH_LIBRARY(optkit_bench_round_trip, m) {
  m.def("core_round_trip_ns(int cpu_a, int cpu_b, int rounds, int batches) -> float", &core_round_trip_ns);
}
