// Splitting a custom call's work over XLA's intra-op threads (the FFI's
// ThreadPool) and the calling thread: shared by jspec's CPU kernels
// (`cpu_kernels.cc`, `cpu_attention.cc`).

#ifndef JSPEC_CPU_THREADS_H_
#define JSPEC_CPU_THREADS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

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
  int64_t panels, panels_per_chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Claims and runs chunks until none is left. Every thread, the caller
// included, does this, so the caller never waits on a task that has not
// started: a pool thread busy elsewhere just finds nothing left to do.
inline void Work(Job& job) {
  for (;;) {
    const int64_t chunk = job.next.fetch_add(1, std::memory_order_relaxed);
    if (chunk >= job.chunks) return;
    const int64_t first = chunk * job.panels_per_chunk;
    const int64_t last = std::min(job.panels, first + job.panels_per_chunk);
    for (int64_t p = first; p < last; ++p) job.panel(p);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// Runs panel(p) for every p in [0, panels) on XLA's intra-op threads and the caller's.
inline void ForEachPanel(ffi::ThreadPool& pool, int64_t panels, std::function<void(int64_t)> panel) {
  auto job = std::make_shared<Job>();
  job->panel = std::move(panel);
  job->panels = panels;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread, so that a thread that starts late still helps.
  job->panels_per_chunk = std::max<int64_t>(1, panels / (4 * threads));
  job->chunks = (panels + job->panels_per_chunk - 1) / job->panels_per_chunk;
  for (int64_t t = 1; t < std::min(threads, job->chunks); ++t) {
    pool.Schedule([job] { Work(*job); });  // the shared_ptr outlives a late task
  }
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
    Relax();
  }
}

}  // namespace jspec_cpu

#endif  // JSPEC_CPU_THREADS_H_
