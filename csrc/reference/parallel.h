// fp8attn: a small std::thread parallel_for for the CPU reference.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fp8attn {

// Number of worker threads for a requested count: 0 = hardware concurrency
// (at least 1).
inline int resolve_num_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Calls fn(task) for every task in [0, num_tasks), spread over up to
// `num_threads` threads (0 = hardware concurrency). Tasks are handed out one
// at a time from a shared counter, so uneven tasks balance themselves. The
// caller's thread works too. The first exception thrown by any task is
// rethrown here after all threads have joined; remaining tasks are skipped.
// Results must not depend on which thread runs a task (each task writes its
// own outputs), so the outcome is the same for every thread count.
template <class Fn>
void parallel_for(int64_t num_tasks, int num_threads, Fn&& fn) {
  if (num_tasks <= 0) return;
  const int64_t nt = std::min<int64_t>(resolve_num_threads(num_threads), num_tasks);
  if (nt <= 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&]() {
    for (;;) {
      const int64_t t = next.fetch_add(1);
      if (t >= num_tasks || failed.load()) return;
      try {
        fn(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(nt - 1));
  for (int64_t i = 0; i + 1 < nt; ++i) threads.emplace_back(worker);
  worker();
  for (auto& th : threads) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace fp8attn
