// CPU matrix multiplies for jspec's decode shapes, as XLA FFI custom calls.
//
//   jspec_gemm_f32(x [M, K] f32, w [P, K, 32] f32) -> y [M, P * 32] f32
//   jspec_gemm_i8(x [M, K] u8, w [P, K/4, 32, 4] s8) -> y [M, P * 32] s32
//   jspec_gemm_s8(x [M, K] s8, w [P, K/4, 32, 4] s8) -> y [M, P * 32] s32
//   jspec_gemm_f32s8(x [M, K] f32, w [P, K, 32] s8) -> y [M, P * 32] f32
//
// `w` is a [K, N] weight stored as N / 32 panels of 32 output columns, each
// panel contiguous ([P, K, 32]; `jspec.layout` "packed"). Why this exists:
// XLA CPU's dot (YNNPACK or Eigen) first packs the weight it is given into
// such panels, then multiplies, so every call reads the whole weight twice
// over and never overlaps the memory reads with the arithmetic. A decode step
// multiplies a few rows by every weight of the model once, so that is where
// its time goes: at 9 rows (a verify) XLA's dot runs at ~31 GB/s against
// ~50 GB/s for this kernel (docs/decisions.md). Stored already in
// panels, the weight streams through once, sequentially, while the FMAs run.
//
// The tile: up to 12 rows x 32 columns of accumulators (24 of the 32 AVX-512
// registers; 3 rows, 12 of 16 registers, with AVX2), one pass over K per
// panel; more rows reuse the panel from L2 block by block (one row on AVX2:
// two panels in step, `RowTile`; 48 rows or more on AVX2: 6 x 16 tiles).
// Written with GCC vector extensions of the host's register width, so it
// builds wherever GCC does.
// Panels are shared between XLA's intra-op threads.
//
// The int8 ones are the draft's (`jspec.quant`): XLA's int8 x int8 dot runs
// at ~21 GB/s on an AVX-512 host, bound by its kernel, not by memory. With
// AVX-512 VNNI four u8 x s8 products accumulate per 32-bit lane in one
// instruction; the weight panels interleave 4 k per output for it. Built
// only where the host has VNNI (`JspecHaveInt8`); AVX2 hosts get the same
// product from four instructions (`JspecHaveS8`, jspec_gemm_s8), one row (a
// draft step) two panels in step as the fp32 one (`RowTileS8`).
//
// jspec_gemm_f32s8 multiplies float activations by int8 weights converted to
// float on the fly: the cheap first pass of the target's greedy head
// (`jspec.greedy_head`), which reads a quarter of the float head's bytes and
// needs x unrounded. Its sums are float sums in another order than the fp32
// kernel's: an estimate, which the caller bounds.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_ffi.h"
#include "cpu_threads.h"

namespace ffi = xla::ffi;

namespace {

using jspec_cpu::CheckParts;
using jspec_cpu::ForEachPanel;
using jspec_cpu::LayerIndex;
using jspec_cpu::WithLayer;

constexpr int64_t kPanel = 32;  // output columns per panel
// Rows per register tile: each row holds 32 accumulators, two AVX-512
// registers (12 rows take 24 of the 32), or four AVX2 ones, of which there
// are only 16: there 3 rows (12 registers) leave room for the weights.
#if defined(__AVX512F__)
constexpr int64_t kRows = 12;
#else
constexpr int64_t kRows = 3;
#endif
// K rows of a panel per block when M needs more than one row tile: 64 KiB
// of f32 panel, which stays in L2 while every row tile passes over it, so
// the weight is read from memory once however many tiles there are. (Whole
// panels of the 1.5B's down projection are 1.1 MiB: a second row tile over
// a whole panel read it from memory again. By hand, 17 rows of the MLP's
// matrices took 6.5 ms that way against 5.7 ms in blocks; docs/decisions.md.)
constexpr int64_t kBlockK = 512;

// One native vector register of floats: a panel row is kVecs of them.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;  // AVX2: GCC splits wider vectors through the stack
#endif
constexpr int64_t kVecs = kPanel / kLanes;
typedef float Vec __attribute__((vector_size(4 * kLanes)));
typedef float VecU __attribute__((vector_size(4 * kLanes), aligned(4)));  // unaligned load

// kLanes int8 weights widened to a Vec of floats. With AVX2 as intrinsics:
// GCC 12 scalarised `__builtin_convertvector` from an 8-byte vector (a
// panel took 2.1x the float kernel's time instead of less).
inline Vec WidenS8(const int8_t* q) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  Vec f;
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(q[i]);
#endif
  Vec out;
  std::memcpy(&out, &f, sizeof(Vec));
  return out;
}

// kLanes weights of a panel row as floats: read, or widened from int8.
inline Vec Load(const float* w) { return *reinterpret_cast<const VecU*>(w); }
inline Vec Load(const int8_t* q) { return WidenS8(q); }

// y[m, 0:W] = sum_k x[m, k] * panel[k, 0:W] for m in [0, MR) and W = NV
// vectors (a whole panel, or with NV < kVecs the first W columns of one:
// `panel` and `y` may point into the middle of a panel row), or with
// `accumulate` y[m, 0:W] + that sum (the same FMAs in the same order as one
// pass over the whole of K: a stored float32 accumulator reloads exactly).
// With PF > 0, next's first ceil(k_size / PF) cache lines are prefetched into
// L2, one every PF k (a template argument: a run-time test in the loop made
// GCC hold the weights in registers and spill an accumulator, 1.2x slower
// at 33 rows). An int8 panel (T = int8_t, `jspec_gemm_f32s8`) has each
// weight widened once for all MR rows.
template <int MR, int NV = kVecs, int PF = 0, typename T = float>
void Tile(const float* x, int64_t ldx, const T* panel, int64_t k_size, float* y,
          int64_t ldy, bool accumulate, const float* next = nullptr) {
  Vec acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      if (accumulate) {
        std::memcpy(&acc[m][v], y + m * ldy + v * kLanes, sizeof(Vec));
      } else {
        acc[m][v] = Vec{};
      }
    }
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const T* row = panel + k * kPanel;
    Vec w[NV];
    for (int v = 0; v < NV; ++v) w[v] = Load(row + v * kLanes);
    // 16 rows (2 KiB) ahead: the hardware prefetcher alone leaves the FMAs
    // waiting at the start of every panel. One line per 16 floats read.
    for (int v = 0; v < NV * kLanes; v += 16) __builtin_prefetch(row + 16 * kPanel + v, 0, 3);
    if (PF && k % PF == 0) __builtin_prefetch(next + 16 * (k / PF), 0, 2);  // into L2
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const float b = x[m * ldx + k];
      for (int v = 0; v < NV; ++v) acc[m][v] += b * w[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) std::memcpy(y + m * ldy + v * kLanes, &acc[m][v], sizeof(Vec));
  }
}

// Two AVX2-only changes for more rows than one tile, which go over K block
// by block (docs/decisions.md, AVX2 rows):
//
// - A wide tile: kWideRows rows x kWideVecs vectors of columns. AVX2 has 16
//   registers: a whole 32-column panel fits only 3 rows (12 accumulators),
//   and GCC then takes every weight operand from memory: 15 loads per 12
//   FMAs, more than Zen 3's two 256-bit loads a cycle. Half a panel x 6
//   rows is 12 accumulators, 2 weight registers and a broadcast: 8 loads
//   per 12 FMAs.
// - The block after the current one is prefetched into L2 while the passes
//   over the current one run: otherwise only the first pass reads memory,
//   one stream per core, and the FMAs of the later passes do not overlap
//   with it. Its 2 x kc lines go one every `stride` k, spread over the
//   first 2 x stride passes: over all of them, up to kMaxStride.
//
// Together they took 0.72-0.79x the time at 17 rows (a 17-wide verify),
// 0.72-0.73x at 24 to 40, 0.85-0.90x at 64 and 0.92x at 9, and within 4%
// at 1, 5, 128 and 320 (`python -m bench.kernel_ab`), against the whole-
// panel tile under 48 rows with the prefetch over at most four passes.
// Without the prefetch the wide tile was no faster under 48 rows.
//
// AVX-512 has room for its whole panel at 12 rows, and neither was
// measured there: it keeps its tile, without the prefetch.
#if defined(__AVX512F__)
constexpr int64_t kWideRows = kRows;
constexpr int kWideVecs = kVecs;
constexpr int kMaxStride = 0;  // no prefetch
#else
constexpr int64_t kWideRows = 6;
constexpr int kWideVecs = 2;
constexpr int kMaxStride = 6;
#endif
constexpr int64_t kWideCols = kWideVecs * kLanes;

// Panels that one row (M = 1, a decode step) streams through at once. That
// product is bound by memory alone, and on a Zen 3 (AVX2) host one core
// reads a single sequential stream at only ~11 GB/s, where XLA's matrix-
// vector product over [out, in] rows reads several rows at once, at ~15-20
// (by hand, per core, on the target's matrices). Two panels in step, each
// with its own accumulators, read as fast as XLA there, and without the
// software prefetch, which on that host slowed a stream (docs/decisions.md). The AVX-512 host reads one panel at 97% of its roofline
// with the prefetch, so it keeps Tile<1>.
#if defined(__AVX512F__)
constexpr int64_t kRowPanels = 1;
#else
constexpr int64_t kRowPanels = 2;
#endif

// y[0, 32p : 32p + 32] = sum_k x[0, k] * panel_p[k, 0:32] for p in [0, NP),
// where panel_p starts at panel + p * panel_stride: for float panels the
// same FMAs in the same order as Tile<1> on each panel, so the output is
// bit for bit the same; int8 panels (`jspec_gemm_f32s8`) widen to float.
template <int NP, typename T = float>
void RowTile(const float* x, const T* panel, int64_t panel_stride, int64_t k_size, float* y) {
  Vec acc[NP][kVecs];
  for (int p = 0; p < NP; ++p) {
    for (int v = 0; v < kVecs; ++v) acc[p][v] = Vec{};
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const float b = x[k];
    for (int p = 0; p < NP; ++p) {
      const T* row = panel + p * panel_stride + k * kPanel;
      for (int v = 0; v < kVecs; ++v) acc[p][v] += b * Load(row + v * kLanes);
    }
  }
  for (int p = 0; p < NP; ++p) {
    for (int v = 0; v < kVecs; ++v) std::memcpy(y + p * kPanel + v * kLanes, &acc[p][v], sizeof(Vec));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool,
                       const float*);
// kTiles[r] is Tile<r> for r in [1, kRows]; kWideTiles[s][r] is
// Tile<r, kWideVecs, s> for r in [1, kWideRows] and s in [0, kMaxStride]:
// with s > 0 it prefetches a line every s k.
template <int NV, int PF, int... R>
constexpr std::array<TileFn, sizeof...(R) + 1> MakeTiles(std::integer_sequence<int, R...>) {
  return {nullptr, Tile<R + 1, NV, PF>...};
}
template <int... S>
constexpr std::array<std::array<TileFn, kWideRows + 1>, sizeof...(S)> MakeWideTiles(
    std::integer_sequence<int, S...>) {
  return {MakeTiles<kWideVecs, S>(std::make_integer_sequence<int, kWideRows>{})...};
}
constexpr auto kTiles = MakeTiles<kVecs, 0>(std::make_integer_sequence<int, kRows>{});
constexpr auto kWideTiles = MakeWideTiles(std::make_integer_sequence<int, kMaxStride + 1>{});

// y[m, 0:32] (int32) = sum_k xu[m, k] * panel[k / 4, 0:32, k % 4] for m in [0, MR):
// unsigned 8-bit activations times signed 8-bit weights, four k at a time
// per 32-bit lane (AVX-512 VNNI `vpdpbusd`; no saturation, and 4 * 255 * 127
// per step leaves room for K in the millions).
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kHaveInt8 = true;

using jspec_cpu::Dpbusd;  // acc += dot4(u8 lanes of a, s8 lanes of b), in place

template <int MR>
void TileI8(const uint8_t* x, int64_t ldx, const int8_t* panel, int64_t groups, int32_t* y,
            int64_t ldy) {
  __m512i lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) {
    lo[m] = _mm512_setzero_si512();
    hi[m] = _mm512_setzero_si512();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* block = panel + g * 4 * kPanel;  // [32 outputs, 4 k]
    const __m512i w_lo = _mm512_loadu_si512(block);
    const __m512i w_hi = _mm512_loadu_si512(block + 64);
    __builtin_prefetch(block + 16 * 4 * kPanel, 0, 3);
    __builtin_prefetch(block + 16 * 4 * kPanel + 64, 0, 3);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      int32_t four;  // x[m, 4g : 4g + 4], one byte per lane byte
      std::memcpy(&four, x + m * ldx + 4 * g, sizeof(four));
      const __m512i b = _mm512_set1_epi32(four);
      lo[m] = Dpbusd(lo[m], b, w_lo);
      hi[m] = Dpbusd(hi[m], b, w_hi);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_si512(y + m * ldy, lo[m]);
    _mm512_storeu_si512(y + m * ldy + 16, hi[m]);
  }
}

using TileI8Fn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int32_t*, int64_t);
// kTilesI8[r] is TileI8<r> for r in [1, kRows].
template <int... R>
constexpr std::array<TileI8Fn, kRows + 1> MakeTilesI8(std::integer_sequence<int, R...>) {
  return {nullptr, TileI8<R + 1>...};
}
constexpr auto kTilesI8 = MakeTilesI8(std::make_integer_sequence<int, kRows>{});
#else
constexpr bool kHaveInt8 = false;  // the Python side then keeps XLA's int8 dot
#endif

// y[m, 0:32] (int32) = sum_k xs[m, k] * panel[k / 4, 0:32, k % 4] for m in [0, MR):
// signed times signed bytes, for hosts with AVX2 but no VNNI (the Python
// side prefers jspec_gemm_i8 where both exist). AVX2 has no four-way byte
// dot, but `vpmaddubsw` multiplies unsigned by signed bytes and adds pairs
// into 16 bits: |x| times w carrying x's sign (`vpsignb`) is each product,
// and with |x| <= 128 and |w| <= 127 (`jspec.quant` clips to +-127) a pair
// is at most 32512 in size, under 16-bit saturation; `vpmaddwd` by ones then
// adds the pairs into the 32-bit lanes. Exact, like the VNNI kernel.
#if defined(__AVX2__)
constexpr bool kHaveS8 = true;
// 8 rows x 4 vectors of accumulators would need 32 of AVX2's 16 registers:
// 2 rows (8) leave room for each row's |x| and sign and the weights.
constexpr int64_t kRowsS8 = 2;

template <int MR>
void TileS8(const int8_t* x, int64_t ldx, const int8_t* panel, int64_t groups, int32_t* y,
            int64_t ldy) {
  constexpr int kV = kPanel / 8;  // 8 outputs (x 4 k) per 32-byte vector
  __m256i acc[MR][kV];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kV; ++v) acc[m][v] = _mm256_setzero_si256();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* block = panel + g * 4 * kPanel;  // [32 outputs, 4 k]
    __builtin_prefetch(block + 16 * 4 * kPanel, 0, 3);
    __builtin_prefetch(block + 16 * 4 * kPanel + 64, 0, 3);
    __m256i a[MR], abs_a[MR];
    for (int m = 0; m < MR; ++m) {
      int32_t four;  // x[m, 4g : 4g + 4], one byte per lane byte
      std::memcpy(&four, x + m * ldx + 4 * g, sizeof(four));
      a[m] = _mm256_set1_epi32(four);
      abs_a[m] = _mm256_abs_epi8(a[m]);
    }
    for (int v = 0; v < kV; ++v) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * v));
      for (int m = 0; m < MR; ++m) {
        const __m256i pairs = _mm256_maddubs_epi16(abs_a[m], _mm256_sign_epi8(w, a[m]));
        acc[m][v] = _mm256_add_epi32(acc[m][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kV; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + 8 * v), acc[m][v]);
    }
  }
}

using TileS8Fn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int32_t*, int64_t);
constexpr std::array<TileS8Fn, kRowsS8 + 1> kTilesS8 = {nullptr, TileS8<1>, TileS8<2>};

// y[0, 32p : 32p + 32] = TileS8<1> of panel_p, for p in [0, NP) and panel_p
// at panel + p * panel_stride: one row (a draft decode step) over NP panels
// in step, so each core reads NP streams, as the fp32 `RowTile` does (one
// sequential stream per core reads at about half the memory's speed on the
// Zen 3 host), and like it without the software prefetch (0.92x TileS8<1>'s
// time with it, 0.85-0.92x without; docs/decisions.md). The same
// integer sums: the output is exactly TileS8<1>'s.
template <int NP>
void RowTileS8(const int8_t* x, const int8_t* panel, int64_t panel_stride, int64_t groups,
               int32_t* y) {
  constexpr int kV = kPanel / 8;
  __m256i acc[NP][kV];
  for (int p = 0; p < NP; ++p) {
    for (int v = 0; v < kV; ++v) acc[p][v] = _mm256_setzero_si256();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    int32_t four;
    std::memcpy(&four, x + 4 * g, sizeof(four));
    const __m256i a = _mm256_set1_epi32(four);
    const __m256i abs_a = _mm256_abs_epi8(a);
    for (int p = 0; p < NP; ++p) {
      const int8_t* block = panel + p * panel_stride + g * 4 * kPanel;
      for (int v = 0; v < kV; ++v) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * v));
        const __m256i pairs = _mm256_maddubs_epi16(abs_a, _mm256_sign_epi8(w, a));
        acc[p][v] = _mm256_add_epi32(acc[p][v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    for (int v = 0; v < kV; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + p * kPanel + 8 * v), acc[p][v]);
    }
  }
}
constexpr int64_t kRowPanelsS8 = 2;
#else
constexpr bool kHaveS8 = false;
#endif

using Matrix = ffi::Buffer<ffi::F32, 2>;  // aliases: the handler macro splits on commas
using Panels = ffi::Buffer<ffi::F32, 3>;

// Whether x [M, K], w [N/32, K, 32] and y [M, N] agree (the float kernels' shapes).
template <typename XDims, typename WDims, typename YDims>
bool PanelShapes(const XDims& xd, const WDims& wd, const YDims& yd) {
  return wd[2] == kPanel && wd[1] == xd[1] && yd[0] == xd[0] && yd[1] == wd[0] * kPanel;
}

ffi::Error GemmF32(ffi::ThreadPool pool, Matrix x, Panels w, ffi::Result<Matrix> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (!PanelShapes(xd, wd, yd)) {
    return ffi::Error::InvalidArgument(
        "jspec_gemm_f32: expected x [M, K], w [N/32, K, 32] and y [M, N]");
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t m_size = xd[0], k_size = xd[1], n_size = yd[1];
  if (kRowPanels > 1 && m_size == 1) {
    const int64_t groups = (wd[0] + kRowPanels - 1) / kRowPanels;
    ForEachPanel(pool, groups, [=](int64_t g) {
      const int64_t p0 = g * kRowPanels;
      if (p0 + kRowPanels <= wd[0]) {
        RowTile<kRowPanels>(xp, wp + p0 * k_size * kPanel, k_size * kPanel, k_size,
                            yp + p0 * kPanel);
        return;
      }
      for (int64_t p = p0; p < wd[0]; ++p) {  // the last panels of an odd count
        Tile<1>(xp, k_size, wp + p * k_size * kPanel, k_size, yp + p * kPanel, n_size, false);
      }
    });
    return ffi::Error::Success();
  }
  // One row tile passes over all of K at once.
  if (m_size <= kRows) {
    ForEachPanel(pool, wd[0], [=](int64_t p) {
      kTiles[m_size](xp, k_size, wp + p * k_size * kPanel, k_size, yp + p * kPanel, n_size,
                     false, nullptr);
    });
    return ffi::Error::Success();
  }
  // More rows go block by block, each row tile over every column slice of
  // the block while its rows of x are in L1.
  const int64_t passes = (m_size + kWideRows - 1) / kWideRows * (kPanel / kWideCols);  // per block
  const int64_t stride = std::min<int64_t>(kMaxStride, std::max<int64_t>(1, passes / 2));  // k per line
  ForEachPanel(pool, wd[0], [=](int64_t p) {
    const float* panel = wp + p * k_size * kPanel;
    for (int64_t k0 = 0; k0 < k_size; k0 += kBlockK) {
      const int64_t kc = std::min(kBlockK, k_size - k0);
      // The block after this one (after the last, the next panel's first):
      // its 2 * kc lines at most, a line per `stride` k of the first
      // 2 * stride passes (a prefetch past the end of w is a no-op).
      const float* next = panel + std::min(k0 + kBlockK, k_size) * kPanel;
      const int64_t lines = stride > 0 ? (kc + stride - 1) / stride : 0;  // per pass
      int64_t pass = 0;
      for (int64_t m0 = 0; m0 < m_size; m0 += kWideRows) {
        const int64_t rows = std::min(kWideRows, m_size - m0);
        for (int64_t c = 0; c < kPanel; c += kWideCols, ++pass) {
          const TileFn tile = kWideTiles[pass < 2 * stride ? stride : 0][rows];
          tile(xp + m0 * k_size + k0, k_size, panel + k0 * kPanel + c, kc,
               yp + m0 * n_size + p * kPanel + c, n_size, k0 > 0, next + pass * lines * 16);
        }
      }
    }
  });
  return ffi::Error::Success();
}

// jspec_gemm_f32s8: one row goes over two int8 panels in step (`RowTile`,
// two streams per core, as the float one-row product); more rows in tiles.
constexpr int64_t kRowPanelsF32S8 = 2;

// More rows: `Tile` over int8 panels, each weight widened once for all its
// rows (row by row, `RowTile` would widen it once per row, and widening costs
// as much as the FMAs). Up to 4 rows x half a panel on AVX2 (8 accumulators
// and 2 weights in its 16 registers), a whole panel on AVX-512.
constexpr int kRowsF32S8 = 4;
constexpr int kVecsF32S8 = kLanes == 8 ? 2 : kVecs;
using TileF32S8Fn = void (*)(const float*, int64_t, const int8_t*, int64_t, float*, int64_t, bool,
                            const float*);
constexpr std::array<TileF32S8Fn, kRowsF32S8 + 1> kTilesF32S8 = {
    nullptr, Tile<1, kVecsF32S8, 0, int8_t>, Tile<2, kVecsF32S8, 0, int8_t>,
    Tile<3, kVecsF32S8, 0, int8_t>, Tile<4, kVecsF32S8, 0, int8_t>};

using S8Panels = ffi::Buffer<ffi::S8, 3>;

ffi::Error GemmF32S8(ffi::ThreadPool pool, Matrix x, S8Panels w, ffi::Result<Matrix> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (!PanelShapes(xd, wd, yd)) {
    return ffi::Error::InvalidArgument(
        "jspec_gemm_f32s8: expected x [M, K] f32, w [N/32, K, 32] s8 and y [M, N]");
  }
  const float* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t m_size = xd[0], k_size = xd[1], n_size = yd[1], stride = k_size * kPanel;
  if (m_size > 1) {  // row tiles over each panel's column slices, each weight widened once
    ForEachPanel(pool, wd[0], [=](int64_t p) {
      for (int64_t m0 = 0; m0 < m_size; m0 += kRowsF32S8) {
        const int64_t rows = std::min<int64_t>(kRowsF32S8, m_size - m0);
        for (int64_t c = 0; c < kPanel; c += kVecsF32S8 * kLanes) {
          kTilesF32S8[rows](xp + m0 * k_size, k_size, wp + p * stride + c, k_size,
                            yp + m0 * n_size + p * kPanel + c, n_size, false, nullptr);
        }
      }
    });
    return ffi::Error::Success();
  }
  const int64_t sets = (wd[0] + kRowPanelsF32S8 - 1) / kRowPanelsF32S8;
  ForEachPanel(pool, sets, [=](int64_t set) {
    const int64_t p0 = set * kRowPanelsF32S8;
    if (p0 + kRowPanelsF32S8 <= wd[0]) {
      RowTile<kRowPanelsF32S8>(xp, wp + p0 * stride, stride, k_size, yp + p0 * kPanel);
      return;
    }
    for (int64_t p = p0; p < wd[0]; ++p) {  // the last panel of an odd count
      RowTile<1>(xp, wp + p * stride, stride, k_size, yp + p * kPanel);
    }
  });
  return ffi::Error::Success();
}

using Bytes = ffi::Buffer<ffi::U8, 2>;
using SignedBytes = ffi::Buffer<ffi::S8, 2>;
using Int8Panels = ffi::Buffer<ffi::S8, 4>;
using Int32Matrix = ffi::Buffer<ffi::S32, 2>;

// One int8 matrix of a product over the same x: its panels, and the first column of y it writes.
struct I8Part {
  const int8_t* w;
  int64_t panels;
  int64_t col;
};

// The int8 kernels' shared body: runs tiles[rows] (a kernel's tiles by row
// count, up to kRowsT) over every row tile of every panel of every part, the
// parts' panels one pool of work for the threads. Each int8 panel is read
// whole per row tile: the draft's matrices are a quarter of the f32 size
// and its steps have few rows. Given a row_tile (`RowTileS8`), a single row
// goes over row_panels panels in step.
template <typename XT, typename TileFnT, size_t kTableSize, typename RowTileFnT = std::nullptr_t>
void RunInt8Parts(ffi::ThreadPool& pool, const XT* xp, int64_t m_size, int64_t k_size,
                  const std::vector<I8Part>& parts, int64_t n_size, int32_t* yp,
                  const std::array<TileFnT, kTableSize>& tiles, RowTileFnT row_tile = nullptr,
                  int64_t row_panels = 1) {
  constexpr int64_t kRowsT = kTableSize - 1;
  const int64_t groups = k_size / 4, stride = groups * 4 * kPanel;
  int64_t per_set = 1;
  if constexpr (!std::is_same_v<RowTileFnT, std::nullptr_t>) {
    if (m_size == 1) per_set = row_panels;
  }
  // Sets of per_set panels, part by part: part j's are [first[j], first[j + 1]).
  std::vector<int64_t> first(parts.size() + 1, 0);
  for (size_t j = 0; j < parts.size(); ++j) {
    first[j + 1] = first[j] + (parts[j].panels + per_set - 1) / per_set;
  }
  ForEachPanel(pool, first.back(), [=](int64_t set) {
    const size_t j = std::upper_bound(first.begin(), first.end(), set) - first.begin() - 1;
    const I8Part& part = parts[j];
    const int64_t p0 = (set - first[j]) * per_set;
    if constexpr (!std::is_same_v<RowTileFnT, std::nullptr_t>) {
      if (m_size == 1) {  // per_set panels in step (`RowTileS8`)
        if (p0 + per_set <= part.panels) {
          row_tile(xp, part.w + p0 * stride, stride, groups, yp + part.col + p0 * kPanel);
          return;
        }
        for (int64_t p = p0; p < part.panels; ++p) {  // the last panels of an odd count
          tiles[1](xp, k_size, part.w + p * stride, groups, yp + part.col + p * kPanel, n_size);
        }
        return;
      }
    }
    const int8_t* panel = part.w + p0 * stride;
    for (int64_t m0 = 0; m0 < m_size; m0 += kRowsT) {
      const int64_t rows = std::min(kRowsT, m_size - m0);
      tiles[rows](xp + m0 * k_size, k_size, panel, groups, yp + m0 * n_size + part.col + p0 * kPanel,
                  n_size);
    }
  });
}

// One int8 matrix: checks the shapes, then `RunInt8Parts`.
template <typename XBuffer, typename TileFnT, size_t kTableSize,
          typename RowTileFnT = std::nullptr_t>
ffi::Error RunInt8(const char* name, ffi::ThreadPool& pool, XBuffer& x, Int8Panels& w,
                   ffi::Result<Int32Matrix>& y,
                   const std::array<TileFnT, kTableSize>& tiles,
                   RowTileFnT row_tile = nullptr, int64_t row_panels = 1) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (wd[2] != kPanel || wd[3] != 4 || 4 * wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] != wd[0] * kPanel) {
    return ffi::Error::InvalidArgument(std::string(name) +
        ": expected x [M, K], w [N/32, K/4, 32, 4] and y [M, N]");
  }
  const std::vector<I8Part> parts = {{w.typed_data(), wd[0], 0}};
  RunInt8Parts(pool, x.typed_data(), xd[0], xd[1], parts, yd[1], y->typed_data(), tiles, row_tile,
               row_panels);
  return ffi::Error::Success();
}

ffi::Error GemmI8(ffi::ThreadPool pool, Bytes x, Int8Panels w, ffi::Result<Int32Matrix> y) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return RunInt8("jspec_gemm_i8", pool, x, w, y, kTilesI8);
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "jspec_gemm_i8: built without AVX-512 VNNI");
#endif
}

ffi::Error GemmS8(ffi::ThreadPool pool, SignedBytes x, Int8Panels w,
                  ffi::Result<Int32Matrix> y) {
#if defined(__AVX2__)
  return RunInt8("jspec_gemm_s8", pool, x, w, y, kTilesS8, RowTileS8<kRowPanelsS8>,
                 kRowPanelsS8);
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "jspec_gemm_s8: built without AVX2");
#endif
}

// The layer variants (`WithLayer`, cpu_ffi.h): the weights picked from one
// buffer per layer by a layer index.

ffi::Error GemmF32Layer(ffi::ThreadPool pool, Matrix x, LayerIndex layer,
                        ffi::RemainingArgs weights, ffi::Result<Matrix> y) {
  return WithLayer<Panels>("jspec_gemm_f32_layer", layer, weights,
                           [&](Panels w) { return GemmF32(pool, x, w, y); });
}

ffi::Error GemmI8Layer(ffi::ThreadPool pool, Bytes x, LayerIndex layer,
                       ffi::RemainingArgs weights, ffi::Result<Int32Matrix> y) {
  return WithLayer<Int8Panels>("jspec_gemm_i8_layer", layer, weights,
                               [&](Int8Panels w) { return GemmI8(pool, x, w, y); });
}

ffi::Error GemmS8Layer(ffi::ThreadPool pool, SignedBytes x, LayerIndex layer,
                       ffi::RemainingArgs weights, ffi::Result<Int32Matrix> y) {
  return WithLayer<Int8Panels>("jspec_gemm_s8_layer", layer, weights,
                               [&](Int8Panels w) { return GemmS8(pool, x, w, y); });
}

// jspec_gemm_i8_many, jspec_gemm_s8_many: several int8 matrices times the
// same x in one call, as jspec_gemm_blk_many does for blocks:
//
//   (x [M, K], layer [] s32, panels...; parts, layers) -> y [M, N_0 + N_1 + ...] s32
//
// Part j's panels of every layer, part after part; layer picks each one's (1
// layer outside the layer loop). y's columns are each part's, bit for bit
// what its own call gives.
template <typename XBuffer>
ffi::Error Int8Parts(const std::string& name, XBuffer& x, LayerIndex& layer,
                     ffi::RemainingArgs& weights, int64_t count, int64_t layers,
                     ffi::Result<Int32Matrix>& y, std::vector<I8Part>& parts) {
  const int64_t i = *layer.typed_data();
  ffi::Error err = CheckParts(name, count, layers, weights.size(), i);
  if (err.failure()) return err;
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  int64_t col = 0;
  for (int64_t j = 0; j < count; ++j) {
    auto w = weights.get<Int8Panels>(j * layers + i);
    if (!w.has_value()) return w.error();
    const auto wd = w->dimensions();
    if (wd[2] != kPanel || wd[3] != 4 || 4 * wd[1] != xd[1]) {
      return ffi::Error::InvalidArgument(name + ": part " + std::to_string(j) +
                                         ": expected x [M, K] and w [N/32, K/4, 32, 4]");
    }
    parts.push_back({w->typed_data(), wd[0], col});
    col += wd[0] * kPanel;
  }
  if (yd[0] != xd[0] || yd[1] != col) {
    return ffi::Error::InvalidArgument(name + ": expected y [M, " + std::to_string(col) +
                                       "], the parts' columns side by side");
  }
  return ffi::Error::Success();
}

ffi::Error GemmI8Many(ffi::ThreadPool pool, Bytes x, LayerIndex layer, ffi::RemainingArgs weights,
                      ffi::Result<Int32Matrix> y, int64_t count, int64_t layers) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  std::vector<I8Part> parts;
  ffi::Error err = Int8Parts("jspec_gemm_i8_many", x, layer, weights, count, layers, y, parts);
  if (err.failure()) return err;
  RunInt8Parts(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], parts,
               y->dimensions()[1], y->typed_data(), kTilesI8);
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "jspec_gemm_i8_many: built without AVX-512 VNNI");
#endif
}

ffi::Error GemmS8Many(ffi::ThreadPool pool, SignedBytes x, LayerIndex layer,
                      ffi::RemainingArgs weights, ffi::Result<Int32Matrix> y, int64_t count,
                      int64_t layers) {
#if defined(__AVX2__)
  std::vector<I8Part> parts;
  ffi::Error err = Int8Parts("jspec_gemm_s8_many", x, layer, weights, count, layers, y, parts);
  if (err.failure()) return err;
  RunInt8Parts(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], parts,
               y->dimensions()[1], y->typed_data(), kTilesS8, RowTileS8<kRowPanelsS8>,
               kRowPanelsS8);
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "jspec_gemm_s8_many: built without AVX2");
#endif
}

}  // namespace

// 1 when jspec_gemm_i8 was built (the host has AVX-512 VNNI), else 0.
extern "C" int JspecHaveInt8() { return kHaveInt8 ? 1 : 0; }

// 1 when jspec_gemm_s8 was built (the host has AVX2), else 0.
extern "C" int JspecHaveS8() { return kHaveS8 ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmF32, GemmF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Panels>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmI8, GemmI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bytes>()
                                  .Arg<Int8Panels>()
                                  .Ret<Int32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmS8, GemmS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<SignedBytes>()
                                  .Arg<Int8Panels>()
                                  .Ret<Int32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmF32S8, GemmF32S8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<S8Panels>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmI8Many, GemmI8Many,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bytes>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Int32Matrix>()
                                  .Attr<int64_t>("parts")
                                  .Attr<int64_t>("layers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmS8Many, GemmS8Many,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<SignedBytes>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Int32Matrix>()
                                  .Attr<int64_t>("parts")
                                  .Attr<int64_t>("layers"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmF32Layer, GemmF32Layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmI8Layer, GemmI8Layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bytes>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Int32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmS8Layer, GemmS8Layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<SignedBytes>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Int32Matrix>());

// jspec_gemm_blk: float activations times int8 block weights, the compact
// form of a GGUF target (`convert.gguf_blocks`):
//
//   jspec_gemm_blk(x [M, K] f32, q [P, K, 32] s8, s [P, K/B, 32] f32,
//                  o [P, K/B, 32] f32) -> y [M, P * 32] f32
//   jspec_gemm_blk_sym(x, q, s) -> y         (no offsets)
//
//   y[m, 32p + c] = sum_k x[m, k] * (s[p, k / B, c] * q[p, k, c] + o[p, k / B, c])
//
// B = K / s.shape[1] is 16 or 32; s and o may instead be factored int8
// panels [P, (K/256)(4 + 256/B), 32] (`BlockScale`), the same numbers in
// fewer bytes. Why: the target's weights as float32 are
// 3-5x the bytes that define them, and a decode step is bound by the bytes
// it reads; as int8 with a float32 scale (and offset) per block they are
// 1.125-1.25 bytes each and still exactly the checkpoint's values.
//
//   jspec_gemm_blk4(x [M, K] f32, q [P, K/2, 32] u8, s, o) -> y [M, P * 32] f32
//   jspec_gemm_blk4_sym(x, q, s) -> y
//
// The same product for q in [0, 15] (Q4_K, Q4_1, Q2_K) stored two to a
// byte: byte [p, i, c] holds q[p, 2i, c] in its low four bits and
// q[p, 2i + 1, c] in its high four, so a 4-bit k-quant reads 0.75 bytes a
// weight instead of 1.25. Each 32-byte row of a panel gives the two k rows
// that the int8 tile takes in one step; they are widened to the same floats
// and summed in the same order, so the output is jspec_gemm_blk's on the
// unpacked q bit for bit.
//
// Per block j of B k: acc = sum_k x[m, k] * q[k, :] over its B k, then
// y += s[j, :] * acc + o[j, :] * (sum of x[m, k] over the block), so each
// weight is widened once for all the rows of a tile, and two FMAs per block
// and row pay for the scale and offset. The sums run in another order than
// jspec_gemm_f32's over the widened weights (within float32 rounding).
// Chosen by measurement on the 2-core AVX-512 VM (docs/decisions-compact.md):
// widening a stretch of the panel into a float32 scratch buffer once and
// running jspec_gemm_f32's tiles over it (each weight widened once for all
// rows, and the output that kernel's bit for bit) took 1.1-1.5x the time of
// these tiles at every M from 7 to 320.
#include <vector>

namespace {

// Rows per register tile of the block path. Each row holds NV block
// accumulators per panel; while they fit, the output's accumulators stay
// in registers too, else each block's sums are added into y (in L1).
// AVX-512: up to 12 rows x a whole panel (24 of 32 registers); AVX2: up to
// 6 rows x half a panel (12 of 16).
constexpr int64_t kBlkRows = kLanes == 16 ? 12 : 6;
constexpr int kBlkVecs = kLanes == 16 ? kVecs : 2;
constexpr int kBlkRegs = kLanes == 16 ? 32 : 16;  // vector registers
// Panels read in step by one row (a decode step) and by up to
// kBlkStepRows rows: one sequential stream per thread reads far below the
// memory bandwidth (on the 2-core AVX-512 VM, 6.5 GB/s with one stream per
// thread against 11 with eight), and each panel in step is three more
// streams (q, scales, offsets). AVX2 takes two, as its fp32 and int8 row
// tiles do (not measured for this kernel: no AVX2 host at hand).
// `BlkRowPanels` picks the block kernel's count at run time.
//
// Build knobs, for A/B builds only (`bench.tools.build_ab`): -D
// JSPEC_BLK_ROW_PANELS=N fixes the block kernel's panels in step for one
// row (N is 1 or kBlkRowPanels: the row tile is built for those only),
// JSPEC_BLK_AHEAD its weight prefetch distance in panel rows and
// JSPEC_BLK_LOCALITY that prefetch's `__builtin_prefetch` locality.
constexpr int kBlkRowPanels = kLanes == 16 ? 4 : 2;
constexpr int kBlkStepPanels = 2;
constexpr int64_t kBlkStepRows = 3;

// Whether this is an AMD host running the AVX-512 build: the host whose
// measurements set the block kernel's run-time choices below.
inline bool AmdAvx512() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return kLanes == 16 && __builtin_cpu_is("amd");
  }();
  return amd;
}

// The block kernel's panels in step for one row: on an AMD host with
// AVX-512 (the Zen 5 host), one. There a panel's three streams per thread
// read faster than four panels' twelve, and the model's target-only step
// was faster for it; the Intel host keeps kBlkRowPanels
// (docs/decisions-compact.md, "One panel for one row on Zen 5").
inline int64_t BlkRowPanels() {
#ifdef JSPEC_BLK_ROW_PANELS
  return JSPEC_BLK_ROW_PANELS;
#else
  return AmdAvx512() ? 1 : kBlkRowPanels;
#endif
}
// Bytes of a panel's q the weight stream is prefetched ahead: 64 rows of
// int8 q, 128 of nibbles.
#ifndef JSPEC_BLK_AHEAD
#define JSPEC_BLK_AHEAD 64
#endif
#ifndef JSPEC_BLK_LOCALITY
#define JSPEC_BLK_LOCALITY 3
#endif
constexpr int64_t kBlkAhead = JSPEC_BLK_AHEAD * kPanel;

// kLanes q in [0, 15] of a nibble panel row as floats: the low four bits of
// each byte (HIGH false: k = 2i) or the high four (HIGH true: k = 2i + 1).
// AVX-512 looks the float up in a 16-entry table (`vpermps` reads only an
// index's low four bits, so the low nibble needs no mask): one operation
// fewer per vector than masking and converting, which matters because one
// row of nibbles is bound by these operations, not by the bytes read
// (docs/decisions-compact.md). AVX2's table would hold only 8 entries: it
// masks and converts.
template <bool HIGH>
inline Vec WidenU4(const uint8_t* q) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m512i wide = _mm512_cvtepu8_epi32(bytes);
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 f = _mm512_permutexvar_ps(HIGH ? _mm512_srli_epi32(wide, 4) : wide, table);
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  const __m256i wide = _mm256_cvtepu8_epi32(bytes);
  const __m256i nib =
      HIGH ? _mm256_srli_epi32(wide, 4) : _mm256_and_si256(wide, _mm256_set1_epi32(15));
  const __m256 f = _mm256_cvtepi32_ps(nib);
#else
  Vec f;
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(HIGH ? q[i] >> 4 : q[i] & 15);
#endif
  Vec out;
  std::memcpy(&out, &f, sizeof(Vec));
  return out;
}

// k row 2i + R of a block panel whose row pair starts at `row`, columns
// [v * kLanes, (v + 1) * kLanes): int8 q (one 32-byte row per k) or nibbles
// (one 32-byte row per two k).
template <int R>
inline Vec WidenRow(const int8_t* row, int v) { return WidenS8(row + R * kPanel + v * kLanes); }
template <int R>
inline Vec WidenRow(const uint8_t* row, int v) { return WidenU4<R == 1>(row + v * kLanes); }
// Bytes of a panel per two k rows.
template <typename Q>
constexpr int64_t kPairBytes = std::is_same<Q, uint8_t>::value ? kPanel : 2 * kPanel;

// Scale (and offset) panels come in two forms. Float: [P, K/B, 32] f32,
// block j's 32 columns at row j. Factored (S = int8_t): a K-quant's block
// scales are d * sc, a float d per 256 k (the super-block) and a small
// integer sc per block, so the panel holds them as such, [P, (K/256)(4 + R),
// 32] bytes with R = 256/B blocks per super-block: super-block g's rows are
// its 32 columns' d as float32 (4 rows of bytes), then its R rows of sc as
// int8. A Q4_K weight's scale and offset then take 3/32 of a byte instead
// of 1/4 (0.59 bytes a weight in all instead of 0.75), a Q6_K's 0.08
// instead of 0.25. float(sc) * d is exact in float32 (d is a float16, sc at
// most 8 bits), and is the float32 product gguf-py's dequantizer computes,
// so both forms give every output the same bits.
constexpr int64_t kSuper = 256;  // k per super-block of a factored scale panel
template <int B>
constexpr int64_t kSuperBlocks = kSuper / B;  // R

// Scales of block j for columns [c, c + kLanes) of one panel's scales.
template <int B>
inline Vec BlockScale(const float* s, int64_t j, int64_t c) { return Load(s + j * kPanel + c); }
template <int B>
inline Vec BlockScale(const int8_t* s, int64_t j, int64_t c) {
  constexpr int64_t R = kSuperBlocks<B>;
  const int8_t* g = s + (j / R) * (4 + R) * kPanel;
  const Vec d = Load(reinterpret_cast<const float*>(g) + c);
  return WidenS8(g + (4 + j % R) * kPanel + c) * d;
}

// The scales a few blocks ahead of block j, into L1: one cache line per
// block, enough to keep ahead of the stream in either form.
template <int B>
inline void PrefetchScales(const float* s, int64_t j, int64_t c) {
  __builtin_prefetch(s + (j + 8) * kPanel + c, 0, 3);
  __builtin_prefetch(s + (j + 8) * kPanel + c + 16, 0, 3);
}
template <int B>
inline void PrefetchScales(const int8_t* s, int64_t j, int64_t c) {
  constexpr int64_t R = kSuperBlocks<B>;
  __builtin_prefetch(s + (j / R + 2) * (4 + R) * kPanel + (j % R) * 64, 0, 3);
}

// Elements of one panel's scale panel over K inputs.
template <int B, typename S>
constexpr int64_t ScaleStride(int64_t k_size) {
  return std::is_same<S, float>::value ? k_size / B * kPanel
                                       : k_size / kSuper * (4 + kSuperBlocks<B>) * kPanel;
}

// For p in [0, NP) and m in [0, MR):
//   y[m, 32p + 0:W] = sum over blocks j of s_p[j] * (sum_k xt[k, m] * q_p[k]) + o_p[j] * xs[j, m]
// where W = NV vectors of columns (q, s, o and y may point into the middle
// of a panel row), q_p = q + p * q_stride, s_p and o_p the panel's scales
// and offsets at s + p * so_stride (float or factored, `BlockScale`: q and y
// start at column c, s and o at the panel's first), over `blocks` blocks of
// B k; Q is int8_t (a byte per q) or
// uint8_t (nibbles, `WidenRow`), read alike. x comes packed for the tile, xt
// [K, MR] and its block sums xs [K/B, MR], so every broadcast is at a fixed
// offset from one pointer. Every output's sums run in the same order
// whatever MR and NP are (and round alike: see the asm below), so a
// row comes out bit for bit the same whichever rows share the call: a
// verify row equals the target-only step's, as with jspec_gemm_f32.
template <typename Q, int MR, int NV, int B, bool OFF, int NP, typename S>
void BlkTile(const float* xt, const float* xs, const Q* q, int64_t q_stride, const S* s,
             const S* o, int64_t so_stride, int64_t c, int64_t blocks, float* y, int64_t ldy) {
  constexpr bool kInRegs = 2 * NP * MR * NV + NV + 3 <= kBlkRegs;
  Vec out[kInRegs ? NP : 1][kInRegs ? MR : 1][NV];
  if constexpr (kInRegs) {
    for (int p = 0; p < NP; ++p) {
      for (int m = 0; m < MR; ++m) {
        for (int v = 0; v < NV; ++v) out[p][m][v] = Vec{};
      }
    }
  }
  for (int64_t j = 0; j < blocks; ++j) {
    const Q* row = q + j * (B / 2) * kPairBytes<Q>;
    const float* xk = xt + j * B * MR;
    Vec acc[NP][MR][NV];
    for (int p = 0; p < NP; ++p) {
      for (int m = 0; m < MR; ++m) {
        for (int v = 0; v < NV; ++v) acc[p][m][v] = Vec{};
      }
    }
#pragma GCC unroll 2
    for (int kk = 0; kk < B; kk += 2) {
      for (int p = 0; p < NP; ++p) {
        __builtin_prefetch(row + p * q_stride + kBlkAhead, 0, JSPEC_BLK_LOCALITY);  // a line per 2 (nibbles 4) rows
      }
      // k rows 2i, then 2i + 1, each over every panel (written out: the row
      // is a template argument of the widening).
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        Vec w[NV];
        for (int v = 0; v < NV; ++v) w[v] = WidenRow<0>(row + p * q_stride, v);
#pragma GCC unroll 12
        for (int m = 0; m < MR; ++m) {
          const float b = xk[m];
          for (int v = 0; v < NV; ++v) acc[p][m][v] += b * w[v];
        }
      }
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) {
        Vec w[NV];
        for (int v = 0; v < NV; ++v) w[v] = WidenRow<1>(row + p * q_stride, v);
#pragma GCC unroll 12
        for (int m = 0; m < MR; ++m) {
          const float b = xk[MR + m];
          for (int v = 0; v < NV; ++v) acc[p][m][v] += b * w[v];
        }
      }
      row += kPairBytes<Q>;
      xk += 2 * MR;
    }
    for (int p = 0; p < NP; ++p) {
      const S* sp = s + p * so_stride;
      const S* op = OFF ? o + p * so_stride : nullptr;
      PrefetchScales<B>(sp, j, c);
      if (OFF) PrefetchScales<B>(op, j, c);
      for (int v = 0; v < NV; ++v) {
        const Vec sv = BlockScale<B>(sp, j, c + v * kLanes);
        const Vec ov = OFF ? BlockScale<B>(op, j, c + v * kLanes) : Vec{};
#pragma GCC unroll 12
        for (int m = 0; m < MR; ++m) {
          // Each product rounded, then added (the asm keeps -ffp-contract
          // from fusing them), alike in every tile.
          Vec part = sv * acc[p][m][v];
          asm("" : "+v"(part));
          if (OFF) {
            Vec shift = ov * xs[j * MR + m];
            asm("" : "+v"(shift));
            part += shift;
          }
          if constexpr (kInRegs) {
            out[p][m][v] += part;
          } else {
            float* dst = y + m * ldy + p * kPanel + v * kLanes;
            if (j > 0) part += Load(dst);
            std::memcpy(dst, &part, sizeof(Vec));
          }
        }
      }
    }
  }
  if constexpr (kInRegs) {
    for (int p = 0; p < NP; ++p) {
      for (int m = 0; m < MR; ++m) {
        for (int v = 0; v < NV; ++v) {
          std::memcpy(y + m * ldy + p * kPanel + v * kLanes, &out[p][m][v], sizeof(Vec));
        }
      }
    }
  }
}

template <typename Q, typename S>
using BlkTileFn = void (*)(const float*, const float*, const Q*, int64_t, const S*, const S*,
                           int64_t, int64_t, int64_t, float*, int64_t);
template <typename Q, int B, bool OFF, int NP, typename S, int NV = kBlkVecs, int... R>
constexpr std::array<BlkTileFn<Q, S>, sizeof...(R) + 1> MakeBlkTiles(
    std::integer_sequence<int, R...>) {
  return {nullptr, BlkTile<Q, R + 1, NV, B, OFF, NP, S>...};
}

// From how many rows on the block kernel's tiles span half a panel (one
// vector of columns, the panel in two passes) instead of a whole one: on an
// AMD host with AVX-512, from 4. There the half tiles multiplied faster at
// 4 to 16 rows, and the default method decoded faster for it
// (docs/decisions-compact.md, "Half-panel tiles for several rows").
// Other AVX-512 hosts from 7, where a whole panel's sums leave the registers
// (on the Xeon the half tiles were as fast at 8 rows and faster at 12;
// fewer rows were not measured there). AVX2 hosts never (half a panel is 8
// columns there; an AVX2 build was slower with them at 5 to 12 rows). Each
// output's sums are the same whatever the tile, so the bits do not change.
// -DJSPEC_BLK_HALF_FROM=N fixes it, for A/B builds only.
inline int64_t BlkHalfFrom() {
#ifdef JSPEC_BLK_HALF_FROM
  return JSPEC_BLK_HALF_FROM;
#else
  return kLanes != 16 ? kBlkRows + 1 : AmdAvx512() ? 4 : 7;
#endif
}

// One matrix of a block product: its panels, and the first column of y it
// writes. s and o are float32 or factored (int8_t) scale panels, alike in
// every part of a call.
template <typename Q>
struct BlkPart {
  const Q* q;
  const void* s;
  const void* o;  // nullptr without offsets
  int64_t panels;
  int64_t col;
};

// y[:, part.col + 0:32 part.panels] = x @ W_part for each part, all of them
// one product over the same x: x is packed once, and the parts' panels are
// one pool of work for the threads, so the call pays one start and one
// uneven finish for all of them. Each column's sums are a one-part call's.
template <typename Q, int B, bool OFF, typename S>
void RunBlk(ffi::ThreadPool& pool, const float* xp, const std::vector<BlkPart<Q>>& parts,
            int64_t m_size, int64_t k_size, int64_t n_size, float* yp) {
  using TileFn = BlkTileFn<Q, S>;
  static constexpr auto tiles =
      MakeBlkTiles<Q, B, OFF, 1, S>(std::make_integer_sequence<int, kBlkRows>{});
  static constexpr auto half_tiles =
      MakeBlkTiles<Q, B, OFF, 1, S, kBlkVecs / 2>(std::make_integer_sequence<int, kBlkRows>{});
  static constexpr auto step_tiles =
      MakeBlkTiles<Q, B, OFF, kBlkStepPanels, S>(std::make_integer_sequence<int, kBlkStepRows>{});
  static constexpr TileFn row_tile = BlkTile<Q, 1, kBlkVecs, B, OFF, kBlkRowPanels, S>;
  const int64_t row_panels = BlkRowPanels();  // 1 or kBlkRowPanels
  const int64_t blocks = k_size / B;
  const int64_t q_stride = k_size / 2 * kPairBytes<Q>, so_stride = ScaleStride<B, S>(k_size);
  // x packed per row tile: tile t (rows m0 .. m0 + r) as [K, r], then its
  // block sums [K/B, r] (for the offsets).
  const int64_t tiles_m = (m_size + kBlkRows - 1) / kBlkRows;
  std::vector<float> packed(m_size * (k_size + blocks));
  for (int64_t t = 0; t < tiles_m; ++t) {
    const int64_t m0 = t * kBlkRows, r = std::min(kBlkRows, m_size - m0);
    float* xt = packed.data() + m0 * (k_size + blocks);
    float* xs = xt + r * k_size;
    for (int64_t m = 0; m < r; ++m) {
      const float* xm = xp + (m0 + m) * k_size;
      for (int64_t k = 0; k < k_size; ++k) xt[k * r + m] = xm[k];
      for (int64_t j = 0; j < blocks; ++j) {
        float total = 0.0f;
        for (int kk = 0; kk < B; ++kk) total += xm[j * B + kk];
        xs[j * r + m] = total;
      }
    }
  }
  const float* xpk = packed.data();
  // Panels in step, np per set (the last set's leftovers one at a time): a
  // row reads several (row_panels), two or three rows two; from
  // BlkHalfFrom() rows on, one, each in two half-panel tiles.
  const bool half = m_size >= BlkHalfFrom();
  const int64_t np = half                      ? 1
                     : m_size == 1             ? row_panels
                     : m_size <= kBlkStepRows ? kBlkStepPanels
                                               : 1;
  const TileFn step = half                      ? nullptr
                      : m_size == 1             ? row_tile
                      : m_size <= kBlkStepRows ? step_tiles[m_size]
                                                : nullptr;
  // Sets of np panels, part by part: part j's are [first[j], first[j + 1]).
  std::vector<int64_t> first(parts.size() + 1, 0);
  for (size_t j = 0; j < parts.size(); ++j) {
    first[j + 1] = first[j] + (parts[j].panels + np - 1) / np;
  }
  ForEachPanel(pool, first.back(), [=](int64_t set) {
    const size_t j = std::upper_bound(first.begin(), first.end(), set) - first.begin() - 1;
    const BlkPart<Q>& part = parts[j];
    const int64_t panels = part.panels, p0 = (set - first[j]) * np;
    for (int64_t t = 0; t < tiles_m; ++t) {
      const int64_t m0 = t * kBlkRows, r = std::min(kBlkRows, m_size - m0);
      const float* xt = xpk + m0 * (k_size + blocks);
      for (int64_t c = 0; c < kPanel; c += kBlkVecs * kLanes) {
        // Panel p's columns from col on (c, or the second half's).
        auto run_at = [&](TileFn tile, int64_t p, int64_t col) {
          const S* s = static_cast<const S*>(part.s);
          tile(xt, xt + r * k_size, part.q + p * q_stride + col, q_stride, s + p * so_stride,
               OFF ? static_cast<const S*>(part.o) + p * so_stride : nullptr, so_stride, col,
               blocks, yp + m0 * n_size + part.col + p * kPanel + col, n_size);
        };
        auto run = [&](TileFn tile, int64_t p) { run_at(tile, p, c); };
        if (np > 1 && p0 + np <= panels) {
          run(step, p0);
        } else if (half) {
          for (int64_t p = p0; p < std::min(p0 + np, panels); ++p) {
            run(half_tiles[r], p);
            run_at(half_tiles[r], p, c + kBlkVecs / 2 * kLanes);
          }
        } else {
          for (int64_t p = p0; p < std::min(p0 + np, panels); ++p) run(tiles[r], p);
        }
      }
    }
  });
}

// The block product with AMX tiles, for calls whose rows need not equal a
// one-row call's bit for bit (`any_order`: a prefill chunk; every mode
// prefills alike). Why: a prefill chunk multiplies 16 rows by every weight,
// and on two cores that is bound by the FMAs; AMX's tile products are not
// (docs/decisions-compact.md, "AMX for prefill chunks").
//
// Each x is split into three bfloat16 pieces whose sum is x exactly (the
// top 8 bits of its significand, the next 8, the last 8), each q widened to
// a bfloat16 exactly (int8 through float32; nibbles by a 16-entry table),
// and `tdpbf16ps` sums the exact products in float32: per block, per row,
// the float32 dot product up to the order of its sums (and denormal pieces,
// which AMX flushes), then the block's scale and offset as BlkTile applies
// them. A row's sums do not depend on the other rows of its tile.
// -DJSPEC_NO_AMX leaves the tiles out, for A/B builds only.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && \
    !defined(JSPEC_NO_AMX)
#define JSPEC_AMX 1
constexpr bool kHaveAmx = true;

constexpr int64_t kAmxRows = 16;  // rows of an A tile and of the accumulators

// Whether this process may use the tiles: Linux hands out AMX's state per
// process on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool AmxReady() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// palette 1: tiles 0-3 accumulate 16 rows x 16 columns each, 4-6 hold the
// rows' three pieces of a block (B bfloat16 a row), 7 one B tile (B/2 rows
// of 16 column pairs).
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

template <int B>
void AmxConfigure() {
  AmxConfig cfg;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = kAmxRows; cfg.colsb[t] = 64; }
  for (int t = 4; t < 7; ++t) { cfg.rows[t] = kAmxRows; cfg.colsb[t] = 2 * B; }
  cfg.rows[7] = B / 2;
  cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

// The B tile of 16 columns of one panel over block j's B k: row r holds,
// per column, the bfloat16s of q[2r] and q[2r + 1] (the pair tdpbf16ps
// takes). `pair` points at the block's first pair row of the panel, at the
// tile's first column.
template <int B>
inline void AmxWiden(const uint8_t* pair, uint32_t* bt) {
  // bfloat16 of 0..15 as 16-bit words; vpermw reads a word's low 5 bits.
  alignas(64) static const uint16_t kTable[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  for (int r = 0; r < B / 2; ++r) {
    // byte = q[2r] | q[2r + 1] << 4 -> dword with q[2r] low, q[2r + 1] at bit 16
    const __m512i d = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + r * kPanel)));
    const __m512i idx = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nibbles, 0xA8);
    _mm512_store_si512(bt + r * 16, _mm512_permutexvar_epi16(idx, table));
  }
}
template <int B>
inline void AmxWiden(const int8_t* pair, uint32_t* bt) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int r = 0; r < B / 2; ++r) {
    const int8_t* row = pair + r * 2 * kPanel;  // k rows 2r, 2r + 1
    const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)))));
    const __m512i b = _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kPanel)))));
    // low word: a's top half; high word: b's top half (an int8 is exact in bfloat16)
    _mm512_store_si512(bt + r * 16,
                       _mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 16), b, high, 0xD8));
  }
}

// Tile products of block j for G groups of 16 columns into accumulators
// 0..G-1 (zeroed first unless ZERO is false), from the pieces' A tiles at a
// (three arrays, lda bytes a row) and the widened B tiles bt[g].
template <int G, bool ZERO = true>
inline void AmxBlock(const uint16_t* a0, const uint16_t* a1, const uint16_t* a2, int64_t lda,
                     const uint32_t (*bt)[16 * 16]) {
  if constexpr (ZERO) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (G > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  _tile_loadd(4, a0, lda);
  _tile_loadd(5, a1, lda);
  _tile_loadd(6, a2, lda);
#define JSPEC_AMX_GROUP(T)   \
  _tile_loadd(7, bt[T], 64); \
  _tile_dpbf16ps(T, 4, 7);   \
  _tile_dpbf16ps(T, 5, 7);   \
  _tile_dpbf16ps(T, 6, 7);
  JSPEC_AMX_GROUP(0)
  JSPEC_AMX_GROUP(1)
  if constexpr (G > 2) {
    JSPEC_AMX_GROUP(2)
    JSPEC_AMX_GROUP(3)
  }
#undef JSPEC_AMX_GROUP
}

template <int G>
inline void AmxStore(float (*ct)[kAmxRows * 16]) {
  _tile_stored(0, ct[0], 64);
  _tile_stored(1, ct[1], 64);
  if constexpr (G > 2) {
    _tile_stored(2, ct[2], 64);
    _tile_stored(3, ct[3], 64);
  }
}

// x [M, K] (K a multiple of B) as three bfloat16 pieces whose sum is x
// exactly, laid out so that each A tile's 16 rows x B are contiguous:
// [ceil(M/16), K/B, 3, 16, B], rows past M zero. (Rows K apart instead
// would put a tile's 16 lines in 4 of L1's 64 sets.)
template <int B>
std::vector<uint16_t> AmxPieces(const float* xp, int64_t m_size, int64_t k_size) {
  const int64_t tiles_m = (m_size + kAmxRows - 1) / kAmxRows, blocks = k_size / B;
  std::vector<uint16_t> pieces(3 * tiles_m * kAmxRows * k_size, 0);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t m = 0; m < m_size; ++m) {
    const float* xm = xp + m * k_size;
    uint16_t* tile = pieces.data() + (m / kAmxRows) * blocks * 3 * kAmxRows * B + (m % kAmxRows) * B;
    for (int64_t k = 0; k < k_size; k += 16) {  // B is 16 or 32: 16 k lie in one block
      __m512 rest = _mm512_loadu_ps(xm + k);
      for (int i = 0; i < 3; ++i) {
        const __m512i top = _mm512_and_si512(_mm512_castps_si512(rest), high);
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(tile + ((k / B) * 3 + i) * kAmxRows * B + k % B),
            _mm512_cvtepi32_epi16(_mm512_srli_epi32(top, 16)));
        rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(top));  // exact: the bits below top's
      }
    }
  }
  return pieces;
}

// `RunBlk`'s product with tiles: the same parts, shapes and output. Per set
// of two panels (four groups of 16 columns) and block, the widening of the
// next block's B tiles runs while the tile unit multiplies this one's; the
// accumulators are stored, and each row's scale and offset terms of a pair
// of blocks are added into y with FMAs while the next pair multiplies.
template <typename Q, int B, bool OFF, typename S>
void RunBlkAmx(ffi::ThreadPool& pool, const float* xp, const std::vector<BlkPart<Q>>& parts,
               int64_t m_size, int64_t k_size, int64_t n_size, float* yp) {
  const int64_t blocks = k_size / B;
  const int64_t q_stride = k_size / 2 * kPairBytes<Q>, so_stride = ScaleStride<B, S>(k_size);
  const int64_t tiles_m = (m_size + kAmxRows - 1) / kAmxRows, m_pad = tiles_m * kAmxRows;
  // x as three bfloat16 pieces (`AmxPieces`), and with offsets the block
  // sums xs [K/B, m_pad].
  const std::vector<uint16_t> pieces = AmxPieces<B>(xp, m_size, k_size);
  std::vector<float> sums(OFF ? m_pad * blocks : 0, 0.0f);
  for (int64_t m = 0; OFF && m < m_size; ++m) {
    const float* xm = xp + m * k_size;
    for (int64_t j = 0; j < blocks; ++j) {
      float total = 0.0f;
      for (int kk = 0; kk < B; ++kk) total += xm[j * B + kk];
      sums[j * m_pad + m] = total;
    }
  }
  const uint16_t* xpc = pieces.data();
  const float* xs = sums.data();
  // Sets of two panels, a part's last odd panel alone.
  std::vector<int64_t> first(parts.size() + 1, 0);
  for (size_t j = 0; j < parts.size(); ++j) first[j + 1] = first[j] + (parts[j].panels + 1) / 2;
  ForEachPanel(pool, first.back(), [=](int64_t set) {
    const size_t part_j = std::upper_bound(first.begin(), first.end(), set) - first.begin() - 1;
    const BlkPart<Q>& part = parts[part_j];
    const int64_t p0 = (set - first[part_j]) * 2, np = std::min<int64_t>(2, part.panels - p0);
    const S* s = static_cast<const S*>(part.s);
    const S* o = OFF ? static_cast<const S*>(part.o) : nullptr;
    alignas(64) uint32_t bt[2][4][16 * 16];  // this block's B tiles and the next's
    // Accumulators of two blocks (a pair), for this pair and the last one.
    alignas(64) float ct[2][2][4][kAmxRows * 16];
    auto widen = [&](int64_t j, uint32_t (*into)[16 * 16]) {
      for (int64_t p = 0; p < np; ++p) {
        const Q* pair = part.q + (p0 + p) * q_stride + j * (B / 2) * kPairBytes<Q>;
        // every line of the panel's block 8 blocks ahead
        constexpr int64_t kBlockBytes = (B / 2) * kPairBytes<Q>;
        for (int64_t line = 0; line < kBlockBytes; line += 64) {
          __builtin_prefetch(pair + 8 * kBlockBytes + line, 0, 3);
        }
        AmxWiden<B>(pair, into[2 * p]);
        AmxWiden<B>(pair + 16, into[2 * p + 1]);
      }
    };
    // y += each row's scale and offset terms of blocks j and j + 1 (where
    // j + 1 < blocks) for row tile t: one pass over y for the two.
    const int64_t ldy = n_size, groups = 2 * np, rows = m_size;
    float* const y0 = yp + part.col + p0 * kPanel;
    auto add = [=](int64_t j, int64_t t, const float (*acc)[4][kAmxRows * 16]) {
      const int64_t m0 = t * kAmxRows, r = std::min(kAmxRows, rows - m0);
      const bool two = j + 1 < blocks;
      const float* xs0 = OFF ? xs + j * m_pad + m0 : nullptr;
      const float* xs1 = OFF && two ? xs0 + m_pad : xs0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t p = p0 + g / 2, c = (g % 2) * 16;
        const Vec s0 = BlockScale<B>(s + p * so_stride, j, c);
        const Vec o0 = OFF ? BlockScale<B>(o + p * so_stride, j, c) : Vec{};
        const Vec s1 = two ? BlockScale<B>(s + p * so_stride, j + 1, c) : Vec{};
        const Vec o1 = OFF && two ? BlockScale<B>(o + p * so_stride, j + 1, c) : Vec{};
        float* y = y0 + m0 * ldy + g * 16;
        const float* a0 = acc[0][g];
        const float* a1 = acc[1][g];
#pragma GCC unroll 4
        for (int64_t m = 0; m < r; ++m) {
          Vec sum = j > 0 ? Load(y + m * ldy) : Vec{};
          sum += s0 * Load(a0 + m * 16);
          if (OFF) sum += o0 * xs0[m];
          if (two) {
            sum += s1 * Load(a1 + m * 16);
            if (OFF) sum += o1 * xs1[m];
          }
          std::memcpy(y + m * ldy, &sum, sizeof(Vec));
        }
      }
    };
    AmxConfigure<B>();
    constexpr int64_t piece = kAmxRows * B;
    for (int64_t t = 0; t < tiles_m; ++t) {
      widen(0, bt[0]);
      // Blocks in pairs; a pair's terms are added while the next pair multiplies.
      for (int64_t jp = 0; jp < blocks; jp += 2) {
        const int64_t slot = (jp / 2) % 2;
        for (int64_t h = 0; h < 2 && jp + h < blocks; ++h) {
          const int64_t j = jp + h;
          const uint16_t* a = xpc + (t * blocks + j) * 3 * piece;
          if (np == 2) {
            AmxBlock<4>(a, a + piece, a + 2 * piece, 2 * B, bt[j % 2]);
            AmxStore<4>(ct[slot][h]);
          } else {
            AmxBlock<2>(a, a + piece, a + 2 * piece, 2 * B, bt[j % 2]);
            AmxStore<2>(ct[slot][h]);
          }
          if (j + 1 < blocks) widen(j + 1, bt[(j + 1) % 2]);
          if (h == 0 && jp > 0) add(jp - 2, t, ct[1 - slot]);
        }
      }
      const int64_t last = (blocks - 1) / 2 * 2;
      add(last, t, ct[(last / 2) % 2]);
    }
    _tile_release();
  });
}
// jspec_gemm_bf16's product with tiles (y [M, 32 panels] = x @ W for W
// bfloat16 panels [P, K, 32], K a multiple of 32): no widening, only each
// pair of k rows interleaved for the B tile, and no blocks, so the four
// accumulators run over all of K and are stored once. Per output, the
// float32 sum of its 3K exact products.
void RunBf16Amx(ffi::ThreadPool& pool, const float* xp, const uint16_t* wp, int64_t m_size,
                int64_t k_size, int64_t panels, int64_t n_size, float* yp) {
  constexpr int B = 32;
  const int64_t blocks = k_size / B, tiles_m = (m_size + kAmxRows - 1) / kAmxRows;
  const std::vector<uint16_t> pieces = AmxPieces<B>(xp, m_size, k_size);
  const uint16_t* xpc = pieces.data();
  ForEachPanel(pool, (panels + 1) / 2, [=](int64_t set) {
    const int64_t p0 = 2 * set, np = std::min<int64_t>(2, panels - p0);
    alignas(64) uint32_t bt[4][16 * 16];
    alignas(64) float ct[4][kAmxRows * 16];
    // word 2c of a B tile row: k row 2r's column c; word 2c + 1: row 2r + 1's
    alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                   6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                   12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_load_si512(kPairs);
    AmxConfigure<B>();
    for (int64_t t = 0; t < tiles_m; ++t) {
      const int64_t m0 = t * kAmxRows, r = std::min(kAmxRows, m_size - m0);
      for (int64_t j = 0; j < blocks; ++j) {
        for (int64_t g = 0; g < 2 * np; ++g) {
          const uint16_t* w = wp + (p0 + g / 2) * k_size * kPanel + j * B * kPanel + (g % 2) * 16;
          for (int64_t row = 0; row < B / 2; ++row) {
            if (g % 2 == 0) {  // the panel's two k rows (a line each), 4 blocks ahead
              __builtin_prefetch(w + (2 * row + 4 * B) * kPanel, 0, 3);
              __builtin_prefetch(w + (2 * row + 1 + 4 * B) * kPanel, 0, 3);
            }
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * row * kPanel));
            const __m256i b =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (2 * row + 1) * kPanel));
            _mm512_store_si512(bt[g] + row * 16, _mm512_permutexvar_epi16(
                pairs, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
          }
        }
        const uint16_t* a = xpc + (t * blocks + j) * 3 * kAmxRows * B;
        constexpr int64_t piece = kAmxRows * B;
        if (j == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        if (np == 2) {
          AmxBlock<4, false>(a, a + piece, a + 2 * piece, 2 * B, bt);
        } else {
          AmxBlock<2, false>(a, a + piece, a + 2 * piece, 2 * B, bt);
        }
      }
      if (np == 2) {
        AmxStore<4>(ct);
      } else {
        AmxStore<2>(ct);
      }
      for (int64_t g = 0; g < 2 * np; ++g) {
        float* y = yp + m0 * n_size + (p0 + g / 2) * kPanel + (g % 2) * 16;
        for (int64_t m = 0; m < r; ++m) std::memcpy(y + m * n_size, ct[g] + m * 16, 64);
      }
    }
    _tile_release();
  });
}
#else
constexpr bool kHaveAmx = false;
bool AmxReady() { return false; }
#endif

// Rows from which an any-order call takes the tiles: at 8 the tiles' Q4_K
// product was no faster than BlkTile's and the Q6_K one slower; a prefill
// chunk has 16 (docs/decisions-compact.md, "AMX for prefill chunks").
constexpr int64_t kAmxMinRows = 16;

// RunBlk for a block size, offsets and scale form known only at run time.
// With any_order, from kAmxMinRows rows on, where the process may use AMX,
// the tiles' product (`RunBlkAmx`).
template <typename Q, typename S>
void RunBlkScales(ffi::ThreadPool& pool, const float* xp, const std::vector<BlkPart<Q>>& parts,
                  int64_t m_size, int64_t k_size, int64_t b, bool offsets, bool any_order,
                  float* yp) {
  const int64_t n_size = parts.back().col + parts.back().panels * kPanel;
  auto run = offsets ? (b == 16 ? RunBlk<Q, 16, true, S> : RunBlk<Q, 32, true, S>)
                     : (b == 16 ? RunBlk<Q, 16, false, S> : RunBlk<Q, 32, false, S>);
#if defined(JSPEC_AMX)
  if (any_order && m_size >= kAmxMinRows && AmxReady()) {
    run = offsets ? (b == 16 ? RunBlkAmx<Q, 16, true, S> : RunBlkAmx<Q, 32, true, S>)
                  : (b == 16 ? RunBlkAmx<Q, 16, false, S> : RunBlkAmx<Q, 32, false, S>);
  }
#endif
  run(pool, xp, parts, m_size, k_size, n_size, yp);
}

template <typename Q>
void RunBlkParts(ffi::ThreadPool& pool, const float* xp, const std::vector<BlkPart<Q>>& parts,
                 int64_t m_size, int64_t k_size, int64_t b, bool offsets, bool factored,
                 float* yp, bool any_order = false) {
  (factored ? RunBlkScales<Q, int8_t> : RunBlkScales<Q, float>)(pool, xp, parts, m_size, k_size, b,
                                                                 offsets, any_order, yp);
}

// The form of a block matrix's scale (or offset) panels for P panels of K
// inputs: float32 [P, K/B, 32], or factored int8 [P, (K/256)(4 + 256/B),
// 32] (`BlockScale`). Sets b (B) and factored; false where neither fits or
// B is not 16 or 32.
bool ScaleForm(const ffi::AnyBuffer& s, int64_t panels, int64_t k, int64_t* b, bool* factored) {
  const auto d = s.dimensions();
  if (d.size() != 3 || d[0] != panels || d[2] != kPanel || d[1] <= 0) return false;
  if (s.element_type() == ffi::DataType::F32) {
    if (k % d[1] != 0) return false;
    *b = k / d[1];
    *factored = false;
  } else if (s.element_type() == ffi::DataType::S8) {
    if (k % kSuper != 0 || d[1] % (k / kSuper) != 0) return false;
    const int64_t r = d[1] / (k / kSuper) - 4;
    if (r <= 0 || kSuper % r != 0) return false;
    *b = kSuper / r;
    *factored = true;
  } else {
    return false;
  }
  return *b == 16 || *b == 32;
}

// What the errors say the scale panels must be.
constexpr const char* kScaleShapes =
    " [N/32, K/B, 32] f32 or factored [N/32, (K/256)(4 + 256/B), 32] s8, with B 16 or 32";

// q panels of nibbles: two q in [0, 15] to a byte.
using U4Panels = ffi::Buffer<ffi::U8, 3>;

// QPanels is S8Panels (a byte per q) or U4Panels (nibbles: K/2 rows).
template <typename QPanels>
ffi::Error GemmBlkAny(const char* name, ffi::ThreadPool& pool, Matrix& x, QPanels& q,
                      ffi::AnyBuffer& s, ffi::AnyBuffer* o, ffi::Result<Matrix>& y) {
  constexpr bool kNibbles = std::is_same<QPanels, U4Panels>::value;
  using Q = std::conditional_t<kNibbles, uint8_t, int8_t>;
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto yd = y->dimensions();
  int64_t b = 0, ob = 0;
  bool factored = false, o_factored = false;
  const bool q_rows = kNibbles ? qd[1] * 2 == xd[1] : qd[1] == xd[1];
  bool ok = q_rows && qd[2] == kPanel && yd[0] == xd[0] && yd[1] == qd[0] * kPanel &&
            ScaleForm(s, qd[0], xd[1], &b, &factored);
  if (o != nullptr) {
    ok = ok && ScaleForm(*o, qd[0], xd[1], &ob, &o_factored) && ob == b &&
         o_factored == factored;
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": expected x [M, K] f32, q " +
        (kNibbles ? "[N/32, K/2, 32] u8" : "[N/32, K, 32] s8") + ", s" +
        (o != nullptr ? " and o (alike)" : "") + kScaleShapes + ", y [M, N]");
  }
  const std::vector<BlkPart<Q>> parts = {{reinterpret_cast<const Q*>(q.typed_data()),
                                          s.untyped_data(),
                                          o != nullptr ? o->untyped_data() : nullptr, qd[0], 0}};
  RunBlkParts(pool, x.typed_data(), parts, xd[0], xd[1], b, o != nullptr, factored,
              y->typed_data());
  return ffi::Error::Success();
}

ffi::Error GemmBlk(ffi::ThreadPool pool, Matrix x, S8Panels q, ffi::AnyBuffer s, ffi::AnyBuffer o,
                   ffi::Result<Matrix> y) {
  return GemmBlkAny("jspec_gemm_blk", pool, x, q, s, &o, y);
}

ffi::Error GemmBlkSym(ffi::ThreadPool pool, Matrix x, S8Panels q, ffi::AnyBuffer s,
                      ffi::Result<Matrix> y) {
  return GemmBlkAny("jspec_gemm_blk_sym", pool, x, q, s, nullptr, y);
}

ffi::Error GemmBlk4(ffi::ThreadPool pool, Matrix x, U4Panels q, ffi::AnyBuffer s,
                    ffi::AnyBuffer o, ffi::Result<Matrix> y) {
  return GemmBlkAny("jspec_gemm_blk4", pool, x, q, s, &o, y);
}

ffi::Error GemmBlk4Sym(ffi::ThreadPool pool, Matrix x, U4Panels q, ffi::AnyBuffer s,
                       ffi::Result<Matrix> y) {
  return GemmBlkAny("jspec_gemm_blk4_sym", pool, x, q, s, nullptr, y);
}

// The layer variants take every layer's q, then every layer's s (then o):
// 2L or 3L buffers after the index.
template <typename QPanels, int kParts>
ffi::Error GemmBlkLayerAny(const char* name, ffi::ThreadPool& pool, Matrix& x, LayerIndex& layer,
                           ffi::RemainingArgs& weights, ffi::Result<Matrix>& y) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kParts;
  const int64_t i = *layer.typed_data();
  if (static_cast<int64_t>(weights.size()) % kParts != 0 || i < 0 || i >= layers) {
    return ffi::Error::InvalidArgument(std::string(name) + ": layer " + std::to_string(i) +
                                       " outside [0, " + std::to_string(layers) + ") or " +
                                       std::to_string(weights.size()) + " buffers not " +
                                       std::to_string(kParts) + " per layer");
  }
  auto q = weights.get<QPanels>(i);
  if (!q.has_value()) return q.error();
  auto s = weights.get<ffi::AnyBuffer>(layers + i);
  if (!s.has_value()) return s.error();
  if (kParts == 2) return GemmBlkAny(name, pool, x, *q, *s, nullptr, y);
  auto o = weights.get<ffi::AnyBuffer>(2 * layers + i);
  if (!o.has_value()) return o.error();
  return GemmBlkAny(name, pool, x, *q, *s, &*o, y);
}

ffi::Error GemmBlkLayer(ffi::ThreadPool pool, Matrix x, LayerIndex layer,
                        ffi::RemainingArgs weights, ffi::Result<Matrix> y) {
  return GemmBlkLayerAny<S8Panels, 3>("jspec_gemm_blk_layer", pool, x, layer, weights, y);
}

ffi::Error GemmBlkSymLayer(ffi::ThreadPool pool, Matrix x, LayerIndex layer,
                           ffi::RemainingArgs weights, ffi::Result<Matrix> y) {
  return GemmBlkLayerAny<S8Panels, 2>("jspec_gemm_blk_sym_layer", pool, x, layer, weights, y);
}

ffi::Error GemmBlk4Layer(ffi::ThreadPool pool, Matrix x, LayerIndex layer,
                         ffi::RemainingArgs weights, ffi::Result<Matrix> y) {
  return GemmBlkLayerAny<U4Panels, 3>("jspec_gemm_blk4_layer", pool, x, layer, weights, y);
}

ffi::Error GemmBlk4SymLayer(ffi::ThreadPool pool, Matrix x, LayerIndex layer,
                            ffi::RemainingArgs weights, ffi::Result<Matrix> y) {
  return GemmBlkLayerAny<U4Panels, 2>("jspec_gemm_blk4_sym_layer", pool, x, layer, weights, y);
}

// jspec_gemm_blk_many: several block matrices of one form (q a byte each or
// nibbles, one B, offsets or none) times the same x, in one call:
//
//   jspec_gemm_blk_many(x [M, K] f32, layer [] s32, buffers...;
//                       parts, layers, nibbles, offsets, any_order) -> y [M, N_0 + N_1 + ...]
//
// Part j's buffers are its q of every layer, then its s of every layer (then
// its o), part after part; layer picks each one's (1 layer outside the layer
// loop, where it is 0). Why: the projections that read the same activations
// (the MLP's gate and up, attention's q and k) each paid a call's start and
// its threads' uneven finish; y's columns are each part's, bit for bit what
// its own call gives.
//
// The parts' buffers start at weights[base] (`jspec_gemm_blk_forms` passes
// one group's).
template <typename QPanels>
ffi::Error GemmBlkManyAny(ffi::ThreadPool& pool, Matrix& x, int64_t i,
                          ffi::RemainingArgs& weights, int64_t base, int64_t count,
                          int64_t layers, bool offsets, ffi::Result<Matrix>& y,
                          bool any_order, const std::string& name = "jspec_gemm_blk_many") {
  constexpr bool kNibbles = std::is_same<QPanels, U4Panels>::value;
  using Q = std::conditional_t<kNibbles, uint8_t, int8_t>;
  const int64_t per = offsets ? 3 : 2;
  if (count < 1 || layers < 1 || base < 0 ||
      static_cast<int64_t>(weights.size()) < base + count * per * layers || i < 0 ||
      i >= layers) {
    return ffi::Error::InvalidArgument(
        name + ": expected " + std::to_string(per) + " buffers per layer for " +
        std::to_string(count) + " parts of " + std::to_string(layers) + " layers and a layer in [0, " +
        std::to_string(layers) + "), got " + std::to_string(weights.size()) + " buffers and layer " +
        std::to_string(i));
  }
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  std::vector<BlkPart<Q>> parts;
  int64_t col = 0, b = 0;
  bool factored = false;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t first = base + j * per * layers;
    auto q = weights.get<QPanels>(first + i);
    if (!q.has_value()) return q.error();
    auto s = weights.get<ffi::AnyBuffer>(first + layers + i);
    if (!s.has_value()) return s.error();
    const auto qd = q->dimensions();
    int64_t pb = 0, ob = 0;
    bool pf = false, of = false;
    bool ok = (kNibbles ? qd[1] * 2 == xd[1] : qd[1] == xd[1]) && qd[2] == kPanel &&
              ScaleForm(*s, qd[0], xd[1], &pb, &pf) && (j == 0 || (pb == b && pf == factored));
    const void* op = nullptr;
    if (offsets) {
      auto o = weights.get<ffi::AnyBuffer>(first + 2 * layers + i);
      if (!o.has_value()) return o.error();
      ok = ok && ScaleForm(*o, qd[0], xd[1], &ob, &of) && ob == pb && of == pf;
      op = o->untyped_data();
    }
    if (!ok) {
      return ffi::Error::InvalidArgument(
          name + ": part " + std::to_string(j) + ": expected x [M, K] f32, q " +
          (kNibbles ? "[N/32, K/2, 32] u8" : "[N/32, K, 32] s8") + ", s" +
          (offsets ? " and o (alike)" : "") + kScaleShapes +
          ", the same B and scale form in every part");
    }
    b = pb;
    factored = pf;
    parts.push_back({reinterpret_cast<const Q*>(q->typed_data()), s->untyped_data(), op, qd[0],
                     col});
    col += qd[0] * kPanel;
  }
  if (yd[0] != xd[0] || yd[1] != col) {
    return ffi::Error::InvalidArgument(name + ": expected y [M, " + std::to_string(col) +
                                       "], the parts' columns side by side");
  }
  RunBlkParts(pool, x.typed_data(), parts, xd[0], xd[1], b, offsets, factored, y->typed_data(),
              any_order);
  return ffi::Error::Success();
}

// any_order (both calls): the rows need not equal a one-row call's bit for
// bit, so from kAmxMinRows rows on AMX hosts take the tiles (`RunBlkAmx`).
ffi::Error GemmBlkMany(ffi::ThreadPool pool, Matrix x, LayerIndex layer, ffi::RemainingArgs weights,
                       ffi::Result<Matrix> y, int64_t parts, int64_t layers, bool nibbles,
                       bool offsets, bool any_order) {
  const int64_t i = *layer.typed_data();
  if (static_cast<int64_t>(weights.size()) != parts * (offsets ? 3 : 2) * layers) {
    return ffi::Error::InvalidArgument("jspec_gemm_blk_many: " + std::to_string(weights.size()) +
                                       " buffers for " + std::to_string(parts) + " parts of " +
                                       std::to_string(layers) + " layers");
  }
  return nibbles ? GemmBlkManyAny<U4Panels>(pool, x, i, weights, 0, parts, layers, offsets, y,
                                            any_order)
                 : GemmBlkManyAny<S8Panels>(pool, x, i, weights, 0, parts, layers, offsets, y,
                                            any_order);
}

// jspec_gemm_blk_forms: one matrix of the layer loop whose layers are held
// in different block forms (a Q4_K_M file keeps some layers' ffn_down in
// Q6_K, the rest in Q4_K). The layers of each form are a group; the call
// reads layer `local` of group `form`:
//
//   jspec_gemm_blk_forms(x [M, K] f32, form [] s32, local [] s32, buffers...;
//                        layers[G], nibbles[G], offsets[G], any_order) -> y [M, N]
//
// Group g's buffers are its q of each of its layers[g] layers, then their s
// (then their o, where offsets[g]), group after group. Why: held in one form,
// the Q4_K layers' 4-bit q were a byte each and every layer's blocks were
// split to 16 weights with offsets (zeros for Q6_K's): 1.5 bytes a weight
// where the file's own forms read 0.75 and 1.25.
ffi::Error GemmBlkForms(ffi::ThreadPool pool, Matrix x, LayerIndex form, LayerIndex local,
                        ffi::RemainingArgs weights, ffi::Result<Matrix> y,
                        ffi::Span<const int64_t> layers, ffi::Span<const int64_t> nibbles,
                        ffi::Span<const int64_t> offsets, bool any_order) {
  const std::string name = "jspec_gemm_blk_forms";
  const int64_t g = *form.typed_data(), groups = static_cast<int64_t>(layers.size());
  int64_t total = 0, base = 0;
  for (int64_t h = 0; h < groups && nibbles.size() == layers.size() &&
                      offsets.size() == layers.size(); ++h) {
    if (h == g) base = total;
    total += layers[h] * (offsets[h] ? 3 : 2);
  }
  if (g < 0 || g >= groups || nibbles.size() != layers.size() ||
      offsets.size() != layers.size() || static_cast<int64_t>(weights.size()) != total) {
    return ffi::Error::InvalidArgument(
        name + ": form " + std::to_string(g) + " outside [0, " + std::to_string(groups) +
        "), or " + std::to_string(weights.size()) + " buffers where the groups hold " +
        std::to_string(total));
  }
  const int64_t i = *local.typed_data();
  return nibbles[g] ? GemmBlkManyAny<U4Panels>(pool, x, i, weights, base, 1, layers[g],
                                               offsets[g] != 0, y, any_order, name)
                    : GemmBlkManyAny<S8Panels>(pool, x, i, weights, base, 1, layers[g],
                                               offsets[g] != 0, y, any_order, name);
}

}  // namespace

// 1 when any-order block products take AMX tiles here (the build has AMX
// and the system lets this process use it), else 0.
extern "C" int JspecHaveAmx() { return kHaveAmx && AmxReady() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlkMany, GemmBlkMany,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("parts")
                                  .Attr<int64_t>("layers")
                                  .Attr<bool>("nibbles")
                                  .Attr<bool>("offsets")
                                  .Attr<bool>("any_order"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlkForms, GemmBlkForms,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>()
                                  .Attr<ffi::Span<const int64_t>>("layers")
                                  .Attr<ffi::Span<const int64_t>>("nibbles")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<bool>("any_order"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlk, GemmBlk,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<S8Panels>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlkSym, GemmBlkSym,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<S8Panels>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlkLayer, GemmBlkLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlkSymLayer, GemmBlkSymLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlk4, GemmBlk4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<U4Panels>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlk4Sym, GemmBlk4Sym,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<U4Panels>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlk4Layer, GemmBlk4Layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBlk4SymLayer, GemmBlk4SymLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>());

// jspec_gemm_bf16: float activations times bfloat16 weights widened exactly
// to float32 (a bfloat16 is the top half of a float32: a 16-bit shift):
//
//   jspec_gemm_bf16(x [M, K] f32, w [P, K, 32] bf16; any_order) -> y [M, P * 32] f32
//
// Why: a checkpoint stored in bfloat16 (HF's Qwen2.5 is) holds its model in
// half of float32's bytes, and a decode step is bound by the bytes it reads.
// The tiles are the block kernel's without the blocks: x packed per row
// tile, one row reading four panels in step (AVX2: two), two or three rows
// two, more rows in tiles of up to 12 (AVX2: 6 rows x half a panel). Every
// output is one FMA chain over k in order, whatever the tile, so a row comes
// out bit for bit the same whichever rows share the call.
namespace {

// kLanes bfloat16 weights as a Vec of floats: each zero-extended to 32 bits
// and shifted into the top half.
inline Vec WidenBf16(const uint16_t* w) {
#if defined(__AVX512F__)
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
#elif defined(__AVX2__)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
#else
  uint32_t bits[kLanes];
  for (int i = 0; i < kLanes; ++i) bits[i] = static_cast<uint32_t>(w[i]) << 16;
#endif
  Vec out;
  std::memcpy(&out, &bits, sizeof(Vec));
  return out;
}

// Panel rows (64 bytes each) the weight stream is prefetched ahead.
constexpr int64_t kBf16Ahead = 32;

// y[m, 32p + 0:W] = sum_k xt[k, m] * w_p[k, 0:W] for p in [0, NP), m in [0, MR),
// W = NV vectors (w and y may point into the middle of a panel row),
// w_p = w + p * stride; x packed for the tile as xt [K, MR].
template <int MR, int NV, int NP>
void Bf16Tile(const float* xt, const uint16_t* w, int64_t stride, int64_t k_size, float* y,
              int64_t ldy) {
  Vec acc[NP][MR][NV];
  for (int p = 0; p < NP; ++p) {
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < NV; ++v) acc[p][m][v] = Vec{};
    }
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const uint16_t* row = w + k * kPanel;
    const float* xk = xt + k * MR;
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      __builtin_prefetch(row + p * stride + kBf16Ahead * kPanel, 0, 3);  // a line per row
      Vec wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = WidenBf16(row + p * stride + v * kLanes);
#pragma GCC unroll 12
      for (int m = 0; m < MR; ++m) {
        const float b = xk[m];
        for (int v = 0; v < NV; ++v) acc[p][m][v] += b * wv[v];
      }
    }
  }
  for (int p = 0; p < NP; ++p) {
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < NV; ++v) {
        std::memcpy(y + m * ldy + p * kPanel + v * kLanes, &acc[p][m][v], sizeof(Vec));
      }
    }
  }
}

using Bf16TileFn = void (*)(const float*, const uint16_t*, int64_t, int64_t, float*, int64_t);
template <int NP, int... R>
constexpr std::array<Bf16TileFn, sizeof...(R) + 1> MakeBf16Tiles(std::integer_sequence<int, R...>) {
  return {nullptr, Bf16Tile<R + 1, kBlkVecs, NP>...};
}

using Bf16Panels = ffi::Buffer<ffi::BF16, 3>;

// any_order: the rows need not equal a one-row call's bit for bit (a
// prefill), so from kAmxMinRows rows on AMX hosts take the tiles (`RunBf16Amx`).
ffi::Error GemmBf16(ffi::ThreadPool pool, Matrix x, Bf16Panels w, ffi::Result<Matrix> y,
                    bool any_order) {
  static constexpr auto tiles = MakeBf16Tiles<1>(std::make_integer_sequence<int, kBlkRows>{});
  static constexpr auto step_tiles =
      MakeBf16Tiles<kBlkStepPanels>(std::make_integer_sequence<int, kBlkStepRows>{});
  static constexpr Bf16TileFn row_tile = Bf16Tile<1, kBlkVecs, kBlkRowPanels>;
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (!PanelShapes(xd, wd, yd)) {
    return ffi::Error::InvalidArgument(
        "jspec_gemm_bf16: expected x [M, K] f32, w [N/32, K, 32] bf16 and y [M, N]");
  }
  const float* xp = x.typed_data();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  const int64_t m_size = xd[0], k_size = xd[1], panels = wd[0], n_size = yd[1];
#if defined(JSPEC_AMX)
  if (any_order && m_size >= kAmxMinRows && k_size % 32 == 0 && AmxReady()) {
    RunBf16Amx(pool, xp, wp, m_size, k_size, panels, n_size, yp);
    return ffi::Error::Success();
  }
#endif
  const int64_t stride = k_size * kPanel;
  // x packed per row tile: tile t (rows m0 .. m0 + r) as [K, r].
  const int64_t tiles_m = (m_size + kBlkRows - 1) / kBlkRows;
  std::vector<float> packed(m_size * k_size);
  for (int64_t t = 0; t < tiles_m; ++t) {
    const int64_t m0 = t * kBlkRows, r = std::min(kBlkRows, m_size - m0);
    float* xt = packed.data() + m0 * k_size;
    for (int64_t m = 0; m < r; ++m) {
      for (int64_t k = 0; k < k_size; ++k) xt[k * r + m] = xp[(m0 + m) * k_size + k];
    }
  }
  const float* xpk = packed.data();
  const int64_t np = m_size == 1 ? kBlkRowPanels : m_size <= kBlkStepRows ? kBlkStepPanels : 1;
  const Bf16TileFn step = m_size == 1 ? row_tile : m_size <= kBlkStepRows ? step_tiles[m_size]
                                                                         : nullptr;
  ForEachPanel(pool, (panels + np - 1) / np, [=](int64_t set) {
    const int64_t p0 = set * np;
    for (int64_t t = 0; t < tiles_m; ++t) {
      const int64_t m0 = t * kBlkRows, r = std::min(kBlkRows, m_size - m0);
      for (int64_t c = 0; c < kPanel; c += kBlkVecs * kLanes) {
        auto run = [&](Bf16TileFn tile, int64_t p) {
          tile(xpk + m0 * k_size, wp + p * stride + c, stride, k_size,
               yp + m0 * n_size + p * kPanel + c, n_size);
        };
        if (np > 1 && p0 + np <= panels) {
          run(step, p0);
        } else {
          for (int64_t p = p0; p < std::min(p0 + np, panels); ++p) run(tiles[r], p);
        }
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error GemmBf16Layer(ffi::ThreadPool pool, Matrix x, LayerIndex layer,
                         ffi::RemainingArgs weights, ffi::Result<Matrix> y, bool any_order) {
  return WithLayer<Bf16Panels>("jspec_gemm_bf16_layer", layer, weights, [&](Bf16Panels w) {
    return GemmBf16(pool, x, w, y, any_order);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBf16, GemmBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<Bf16Panels>()
                                  .Ret<Matrix>()
                                  .Attr<bool>("any_order"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmBf16Layer, GemmBf16Layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>()
                                  .Attr<bool>("any_order"));
