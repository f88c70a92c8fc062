// The 4-bit draft's products on int8 activations, as XLA FFI custom calls:
//
//   jspec_gemm_i4(xq [M, K] s8, w [N/32, K/32, 640] u8) -> y [M, N] f32
//   jspec_gemm_i4_layer(xq, layer [] s32, w per layer...) -> y
//   jspec_gemm_i4_many(xq, layer [] s32, w per part and layer...; parts, layers)
//       -> y [M, N_0 + N_1 + ...]
//
// A 4-bit draft matrix holds, per output n and block j of 32 inputs, a
// scale s and an offset o (float16) and q in [0, 15]: W[k, n] = s q + o.
// Its panel (32 outputs) is one stream of 640-byte blocks: 512 bytes of q,
// then the 32 outputs' s, then their o, as float16 (`jspec.cpu_kernels.pack_int4`).
// Byte b of 32-bit lane l in the 64 bytes at 128 c + 64 h holds output
// 16 h + l's q at input 32 j + 8 c + b (low nibble) and 32 j + 8 c + 4 + b
// (high nibble): masked and shifted, the nibbles are the unsigned operand of
// `vpdpbusd`, which adds four q x xq products per lane in int32, exactly.
//
//   y[m, n] = sum_j s[n, j] * (sum_{k in j} q[n, k] xq[m, k]) + o[n, j] * (sum_{k in j} xq[m, k])
//
// The caller multiplies y by each row's activation scale. Why: the draft
// only proposes, so its weights may be rounded; a step reads its weights
// once, and this form is 0.625 bytes a weight against the int8 draft's one
// (docs/decisions-compact.md, "The 4-bit draft on int8 activations").
// Needs AVX-512 VNNI; elsewhere `JspecHaveInt4` is 0 and the Python side
// keeps the 4-bit draft on the float block kernel.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_ffi.h"
#include "cpu_threads.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;   // outputs per panel
constexpr int64_t kBlock = 32;   // inputs per scale and offset
constexpr int64_t kQBytes = 512;  // q bytes of a block (32 x 32 nibbles)
constexpr int64_t kBlockBytes = kQBytes + 2 * 2 * kPanel;  // q, then s and o as float16

using SignedBytes = ffi::Buffer<ffi::S8, 2>;  // aliases: the handler macro splits on commas
using Int4Panels = ffi::Buffer<ffi::U8, 3>;
using Matrix = ffi::Buffer<ffi::F32, 2>;
using jspec_cpu::LayerIndex;

// One matrix of a call: its panels, and the first column of y it writes.
struct Part {
  const uint8_t* w;
  int64_t panels;
  int64_t col;
};

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kHaveInt4 = true;
constexpr int kRows = 4;  // rows per tile: 4 registers each (2 int32 sums, 2 float outputs)

using jspec_cpu::Dpbusd;  // acc += dot4(u8 lanes of a, s8 lanes of b), in place

// y[m, 0:32] = the formula above over one panel, for rows m in [0, MR);
// xs[m * blocks + j] is row m's sum of xq over block j.
template <int MR>
void Tile(const int8_t* x, int64_t ldx, const float* xs, const uint8_t* panel, int64_t blocks,
          float* y, int64_t ldy) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 out[MR][2];
  for (int m = 0; m < MR; ++m) out[m][0] = out[m][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
    const uint8_t* blk = panel + j * kBlockBytes;
    // The stream four blocks ahead into L2: a plain loop over this layout
    // read faster so than with no prefetch or into L1 (by hand).
    for (int64_t line = 0; line < kBlockBytes; line += 64) {
      __builtin_prefetch(blk + 4 * kBlockBytes + line, 0, 2);
    }
    __m512i acc[MR][2];
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i w0 = _mm512_loadu_si512(blk + c * 128);
      const __m512i w1 = _mm512_loadu_si512(blk + c * 128 + 64);
      const __m512i lo0 = _mm512_and_si512(w0, low);
      const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), low);
      const __m512i lo1 = _mm512_and_si512(w1, low);
      const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), low);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        int32_t first, second;  // xq[m, 32 j + 8 c + 0:4] and [+ 4:8]
        std::memcpy(&first, x + m * ldx + j * kBlock + 8 * c, sizeof(first));
        std::memcpy(&second, x + m * ldx + j * kBlock + 8 * c + 4, sizeof(second));
        const __m512i b0 = _mm512_set1_epi32(first), b1 = _mm512_set1_epi32(second);
        acc[m][0] = Dpbusd(Dpbusd(acc[m][0], lo0, b0), hi0, b1);
        acc[m][1] = Dpbusd(Dpbusd(acc[m][1], lo1, b0), hi1, b1);
      }
    }
    const uint8_t* so = blk + kQBytes;
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so)));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so + 32)));
    const __m512 o0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so + 64)));
    const __m512 o1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so + 96)));
    for (int m = 0; m < MR; ++m) {
      const __m512 sum = _mm512_set1_ps(xs[m * blocks + j]);
      out[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), s0, out[m][0]);
      out[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][1]), s1, out[m][1]);
      out[m][0] = _mm512_fmadd_ps(sum, o0, out[m][0]);
      out[m][1] = _mm512_fmadd_ps(sum, o1, out[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(y + m * ldy, out[m][0]);
    _mm512_storeu_ps(y + m * ldy + 16, out[m][1]);
  }
}

using TileFn = void (*)(const int8_t*, int64_t, const float*, const uint8_t*, int64_t, float*,
                        int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>, Tile<4>};

// Every part's panels, one pool of work for the threads; each panel's rows
// in tiles of kRows (a panel's later tiles read it from cache).
void Run(ffi::ThreadPool& pool, const int8_t* x, int64_t m_size, int64_t k_size,
         const std::vector<Part>& parts, int64_t n_size, float* y) {
  const int64_t blocks = k_size / kBlock;
  std::vector<float> sums(m_size * blocks);  // [M, K/32]: each row's xq summed per block
  for (int64_t m = 0; m < m_size; ++m) {
    for (int64_t j = 0; j < blocks; ++j) {
      int32_t total = 0;
      for (int64_t k = 0; k < kBlock; ++k) total += x[m * k_size + j * kBlock + k];
      sums[m * blocks + j] = static_cast<float>(total);
    }
  }
  std::vector<int64_t> first(parts.size() + 1, 0);  // part j's panels: [first[j], first[j + 1])
  for (size_t j = 0; j < parts.size(); ++j) first[j + 1] = first[j] + parts[j].panels;
  const float* xs = sums.data();
  jspec_cpu::ForEachPanel(pool, first.back(), [=](int64_t panel) {
    const size_t j = std::upper_bound(first.begin(), first.end(), panel) - first.begin() - 1;
    const Part& part = parts[j];
    const int64_t p = panel - first[j];
    const uint8_t* w = part.w + p * blocks * kBlockBytes;
    for (int64_t m0 = 0; m0 < m_size; m0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m_size - m0);
      kTiles[rows](x + m0 * k_size, k_size, xs + m0 * blocks, w, blocks,
                   y + m0 * n_size + part.col + p * kPanel, n_size);
    }
  });
}
#else
constexpr bool kHaveInt4 = false;
#endif

// Checks one part's buffer against x and appends it to parts.
ffi::Error AddPart(const std::string& name, const SignedBytes& x, const Int4Panels& w,
                   std::vector<Part>& parts, int64_t& col) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd[1] % kBlock != 0 || wd[1] * kBlock != xd[1] || wd[2] != kBlockBytes) {
    return ffi::Error::InvalidArgument(
        name + ": expected xq [M, K] with K a multiple of 32 and w [N/32, K/32, 640]");
  }
  parts.push_back({w.typed_data(), wd[0], col});
  col += wd[0] * kPanel;
  return ffi::Error::Success();
}

ffi::Error RunParts(const std::string& name, ffi::ThreadPool& pool, const SignedBytes& x,
                    const std::vector<Part>& parts, int64_t col, ffi::Result<Matrix>& y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (yd[0] != xd[0] || yd[1] != col) {
    return ffi::Error::InvalidArgument(name + ": expected y [M, " + std::to_string(col) + "]");
  }
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
  Run(pool, x.typed_data(), xd[0], xd[1], parts, yd[1], y->typed_data());
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, name + ": built without AVX-512 VNNI");
#endif
}

ffi::Error GemmI4(ffi::ThreadPool pool, SignedBytes x, Int4Panels w, ffi::Result<Matrix> y) {
  std::vector<Part> parts;
  int64_t col = 0;
  ffi::Error err = AddPart("jspec_gemm_i4", x, w, parts, col);
  if (err.failure()) return err;
  return RunParts("jspec_gemm_i4", pool, x, parts, col, y);
}

ffi::Error GemmI4Layer(ffi::ThreadPool pool, SignedBytes x, LayerIndex layer,
                       ffi::RemainingArgs weights, ffi::Result<Matrix> y) {
  return jspec_cpu::WithLayer<Int4Panels>("jspec_gemm_i4_layer", layer, weights,
                                          [&](Int4Panels w) { return GemmI4(pool, x, w, y); });
}

// Part j's buffers of every layer, part after part; `layer` picks each
// one's (1 layer outside the layer loop). y's columns are each part's, as
// its own call gives them.
ffi::Error GemmI4Many(ffi::ThreadPool pool, SignedBytes x, LayerIndex layer,
                      ffi::RemainingArgs weights, ffi::Result<Matrix> y, int64_t count,
                      int64_t layers) {
  const std::string name = "jspec_gemm_i4_many";
  const int64_t i = *layer.typed_data();
  ffi::Error err = jspec_cpu::CheckParts(name, count, layers, weights.size(), i);
  if (err.failure()) return err;
  std::vector<Part> parts;
  int64_t col = 0;
  for (int64_t j = 0; j < count; ++j) {
    auto w = weights.get<Int4Panels>(j * layers + i);
    if (!w.has_value()) return w.error();
    err = AddPart(name, x, *w, parts, col);
    if (err.failure()) return err;
  }
  return RunParts(name, pool, x, parts, col, y);
}

}  // namespace

// 1 when jspec_gemm_i4 was built to run (the host has AVX-512 VNNI), else 0.
extern "C" int JspecHaveInt4() { return kHaveInt4 ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmI4, GemmI4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<SignedBytes>()
                                  .Arg<Int4Panels>()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmI4Layer, GemmI4Layer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<SignedBytes>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecGemmI4Many, GemmI4Many,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<SignedBytes>()
                                  .Arg<LayerIndex>()
                                  .RemainingArgs()
                                  .Ret<Matrix>()
                                  .Attr<int64_t>("parts")
                                  .Attr<int64_t>("layers"));
