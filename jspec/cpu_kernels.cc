// A CPU matrix multiply for jspec's decode shapes, as an XLA FFI custom call.
//
//   jspec_gemm_f32(x [M, K] f32, w [P, K, 32] f32) -> y [M, P * 32] f32
//
// `w` is a [K, N] weight stored as N / 32 panels of 32 output columns, each
// panel contiguous ([P, K, 32]; `jspec.layout` "packed"). Why this exists:
// XLA CPU's dot (YNNPACK or Eigen) first packs the weight it is given into
// such panels, then multiplies, so every call reads the whole weight twice
// over and never overlaps the memory reads with the arithmetic. A decode step
// multiplies a few rows by every weight of the model once, so that is where
// its time goes: at 9 rows (a verify) XLA's dot runs at ~31 GB/s against
// ~50 GB/s for this kernel (README "Design measurements"). Stored already in
// panels, the weight streams through once, sequentially, while the FMAs run.
//
// The tile: up to 12 rows x 32 columns of accumulators (24 of the 32 AVX-512
// registers), one pass over K per panel; more rows reuse the panel from L2.
// Written with GCC vector extensions, so it also builds (slower) where
// AVX-512 is missing. Panels are shared between XLA's intra-op threads.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel
constexpr int64_t kRows = 12;   // rows per register tile

typedef float Vec __attribute__((vector_size(64)));                // 16 floats
typedef float VecU __attribute__((vector_size(64), aligned(4)));   // unaligned load

// y[m, 0:32] = sum_k x[m, k] * panel[k, 0:32] for m in [0, MR).
template <int MR>
void Tile(const float* x, int64_t ldx, const float* panel, int64_t k_size, float* y,
          int64_t ldy) {
  Vec lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) {
    lo[m] = Vec{};
    hi[m] = Vec{};
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const float* row = panel + k * kPanel;
    const Vec w_lo = *reinterpret_cast<const VecU*>(row);
    const Vec w_hi = *reinterpret_cast<const VecU*>(row + 16);
    // 16 rows (2 KiB) ahead: the hardware prefetcher alone leaves the FMAs
    // waiting at the start of every panel.
    __builtin_prefetch(row + 16 * kPanel, 0, 3);
    __builtin_prefetch(row + 16 * kPanel + 16, 0, 3);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const float b = x[m * ldx + k];
      lo[m] += b * w_lo;
      hi[m] += b * w_hi;
    }
  }
  for (int m = 0; m < MR; ++m) {
    std::memcpy(y + m * ldy, &lo[m], sizeof(Vec));
    std::memcpy(y + m * ldy + 16, &hi[m], sizeof(Vec));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr,   Tile<1>,  Tile<2>, Tile<3>, Tile<4>,
                                      Tile<5>,   Tile<6>,  Tile<7>, Tile<8>, Tile<9>,
                                      Tile<10>,  Tile<11>, Tile<12>};

// A spin-wait hint: the chunks still running take microseconds.
inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// One multiply, split into chunks of panels that threads claim in turn.
struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t m_size, k_size, n_size;
  int64_t panels, panels_per_chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void RunChunk(const Job& job, int64_t chunk) {
  const int64_t first = chunk * job.panels_per_chunk;
  const int64_t last = std::min(job.panels, first + job.panels_per_chunk);
  for (int64_t p = first; p < last; ++p) {
    const float* panel = job.w + p * job.k_size * kPanel;
    for (int64_t m0 = 0; m0 < job.m_size; m0 += kRows) {
      const int64_t rows = std::min(kRows, job.m_size - m0);
      kTiles[rows](job.x + m0 * job.k_size, job.k_size, panel, job.k_size,
                   job.y + m0 * job.n_size + p * kPanel, job.n_size);
    }
  }
}

// Claims and runs chunks until none is left. Every thread, the caller
// included, does this, so the caller never waits on a task that has not
// started: a pool thread busy elsewhere just finds nothing left to do.
void Work(Job& job) {
  for (;;) {
    const int64_t chunk = job.next.fetch_add(1, std::memory_order_relaxed);
    if (chunk >= job.chunks) return;
    RunChunk(job, chunk);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: the handler macro splits on commas
using Panels = ffi::Buffer<ffi::F32, 3>;

ffi::Error GemmF32(ffi::ThreadPool pool, Matrix x, Panels w, ffi::Result<Matrix> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (wd[2] != kPanel || wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != wd[0] * kPanel) {
    return ffi::Error::InvalidArgument(
        "jspec_gemm_f32: expected x [M, K], w [N/32, K, 32] and y [M, N]");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->m_size = xd[0];
  job->k_size = xd[1];
  job->n_size = yd[1];
  job->panels = wd[0];
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few chunks per thread, so that a thread that starts late still helps.
  job->panels_per_chunk = std::max<int64_t>(1, job->panels / (4 * threads));
  job->chunks = (job->panels + job->panels_per_chunk - 1) / job->panels_per_chunk;
  for (int64_t t = 1; t < std::min(threads, job->chunks); ++t) {
    pool.Schedule([job] { Work(*job); });  // the shared_ptr outlives a late task
  }
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
    Relax();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmF32, GemmF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Panels>()
                                  .Ret<Matrix>());
