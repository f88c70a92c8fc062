// Splitting a custom call's work over the calling thread and helper
// threads, one per XLA intra-op thread beyond it (the FFI's ThreadPool
// gives the count): shared by jspec's CPU kernels (`cpu_kernels.cc`,
// `cpu_attention.cc`).

#ifndef JSPEC_CPU_THREADS_H_
#define JSPEC_CPU_THREADS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jspec_cpu {

namespace ffi = xla::ffi;

// A spin-wait hint: the chunks still running take microseconds.
inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// One multiply, split into chunks of panels that threads claim in turn.
struct Job {
  std::function<void(int64_t)> panel;  // computes every row's outputs in one panel
  int64_t panels;  // panel(p) runs for p in [0, panels)
  int64_t shares;  // a claim takes 1/shares of the panels left, at least one
  std::atomic<int64_t> next{0};  // the first panel not claimed yet
  std::atomic<int64_t> done{0};  // panels finished
};

// Claims and runs chunks until none is left. Every thread, the caller
// included, does this, so the caller never waits on a thread that has not
// started: a helper busy elsewhere just finds nothing left to do. Chunks
// shrink as the panels run out (guided scheduling): the first are large,
// so claims are few, and the last are one panel, so the threads finish
// within a panel of each other.
inline void Work(Job& job) {
  int64_t first = job.next.load(std::memory_order_relaxed);
  for (;;) {
    int64_t size;
    do {
      if (first >= job.panels) return;
      size = std::max<int64_t>(1, (job.panels - first) / job.shares);
    } while (!job.next.compare_exchange_weak(first, first + size, std::memory_order_relaxed));
    for (int64_t p = first; p < first + size; ++p) job.panel(p);
    job.done.fetch_add(size, std::memory_order_release);
    first = job.next.load(std::memory_order_relaxed);
  }
}

// A thread that claims chunks of the jobs posted to it beside their
// callers, and spins for a while after each before it sleeps. A decode
// step is a chain of calls each a fraction of a millisecond long, and an
// XLA pool thread woken for each one joined it late
// (docs/decisions-compact.md, "A helper thread that waits awake").
class Helper {
 public:
  Helper() { std::thread([this] { Loop(); }).detach(); }

  // Hands job to this helper. A job posted while the helper still works
  // on an earlier one replaces any not yet taken: its caller runs it alone.
  void Post(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = job;
      posted_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
  }

 private:
  // How long the helper spins after a job before it sleeps.
  static constexpr auto kAwake = std::chrono::microseconds(500);

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int64_t spins = 1; posted_.load(std::memory_order_acquire) == seen; ++spins) {
        Relax();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kAwake) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return posted_.load(std::memory_order_acquire) != seen; });
          start = std::chrono::steady_clock::now();
        }
      }
      std::shared_ptr<Job> job;  // kept until Work returns, whenever the caller returns
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = posted_.load(std::memory_order_acquire);
        job = std::move(job_);
      }
      if (job) Work(*job);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> posted_{0};
  std::shared_ptr<Job> job_;  // guarded by mu_
};

// The helpers: one per intra-op thread beyond the caller's, made by the
// first call and kept (never destroyed) for the life of the process.
inline const std::vector<Helper*>& Helpers(int64_t threads) {
  static const std::vector<Helper*>* helpers = [threads] {
    auto* made = new std::vector<Helper*>;
    for (int64_t t = 1; t < threads; ++t) made->push_back(new Helper);
    return made;
  }();
  return *helpers;
}

// Runs panel(p) for every p in [0, panels) on the caller's thread and the helpers.
inline void ForEachPanel(ffi::ThreadPool& pool, int64_t panels, std::function<void(int64_t)> panel) {
  auto job = std::make_shared<Job>();
  job->panel = std::move(panel);
  job->panels = panels;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  job->shares = 2 * threads;
  const auto& helpers = Helpers(threads);
  for (size_t t = 0; t < helpers.size() && static_cast<int64_t>(t) + 1 < panels; ++t) {
    helpers[t]->Post(job);
  }
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->panels) {
    Relax();
  }
}

}  // namespace jspec_cpu

#endif  // JSPEC_CPU_THREADS_H_
