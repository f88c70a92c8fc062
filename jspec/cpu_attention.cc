// Decode attention over a read-only KV cache, as an XLA FFI custom call.
//
//   jspec_attend_f32(q [B, T, N, H], k_new [B, T, K, H], v_new [B, T, K, H],
//                    starts [B] s32, layer [] s32,
//                    k_cache [L, B, S, K, H], v_cache [L, B, S, K, H]) -> out [B, T, N, H]
//
// Query t of row b (position starts[b] + t) attends to cache slots
// [0, starts[b]) of layer `layer` and to new tokens [0, t] of its own chunk,
// grouped-query: query head n reads kv head n / (N / K). That is what
// `jspec.model.Attention` computes after writing the chunk into the cache,
// without the write. Why this exists: inside the loop over layers XLA
// copied each layer's keys and values out of the stacked cache, and
// transposed them, for its dots, at about 0.9 us per slot and layer
// (docs/decisions.md): 8% of a decode step at 512 slots,
// growing with the context. Here each key and value row is read in place.
//
// Each query's scores, softmax and weighted sum run over its visible slots
// in slot order, cached ones first, with one code path whichever side a slot
// is on: a position's output is bit for bit the same whether its earlier
// tokens came in the same chunk or are already cached (a verify and the
// decode steps it stands for agree exactly).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_threads.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(4 * kLanes)));
typedef float VecU __attribute__((vector_size(4 * kLanes), aligned(4)));  // unaligned load

inline Vec Load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void Store(float* p, Vec v) { *reinterpret_cast<VecU*>(p) = v; }

// The lanes' sum as a tree (the upper half added to the lower until one lane
// is left): a few vector adds where a lane-by-lane sum was a chain of kLanes
// dependent scalar adds per score, which held long contexts' attention back.
inline float SumLanes(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 w = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
#else
  float sum = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
#endif
}

// Cached slots ahead of the one in use whose row is prefetched. A kv head's
// row is H floats of a slot's K * H, so one head's slots lie 1 KiB or more
// apart: a stride the hardware prefetcher did not follow, and the scores'
// loop, one dependent chain of FMAs per key, kept few misses in flight, so
// long contexts waited on memory a key at a time (docs/decisions.md,
// "Attention kernel").
constexpr int64_t kAheadSlots = 8;

// Every cache line of a row of `size` floats, into L1.
inline void PrefetchRow(const float* row, int64_t size) {
  for (int64_t h = 0; h < size; h += 64 / sizeof(float)) __builtin_prefetch(row + h, 0, 3);
}

// out[i * out_stride] = scale * sum_h queries[i * size + h] * key[h] for i
// in [0, N): each sum lanes first, then their sum (`SumLanes`), then the
// tail, in the same order for every call of one size and whatever N is. The
// key is read once for the N queries, and their chains of FMAs are
// independent.
template <int N>
inline void Dots(const float* queries, const float* key, int64_t size, float scale, float* out,
                 int64_t out_stride) {
  Vec acc[N];
  for (int i = 0; i < N; ++i) acc[i] = Vec{};
  int64_t h = 0;
  for (; h + kLanes <= size; h += kLanes) {
    const Vec k = Load(key + h);
    for (int i = 0; i < N; ++i) acc[i] += Load(queries + i * size + h) * k;
  }
  for (int i = 0; i < N; ++i) {
    float sum = SumLanes(acc[i]);
    for (int64_t r = h; r < size; ++r) sum += queries[i * size + r] * key[r];
    out[i * out_stride] = sum * scale;
  }
}

// `Dots` for any n queries, kMaxDots at a time.
constexpr int64_t kMaxDots = 8;
inline void DotsAny(int64_t n, const float* queries, const float* key, int64_t size, float scale,
                    float* out, int64_t out_stride) {
  for (int64_t i = 0; i < n; i += kMaxDots) {
    const float* qi = queries + i * size;
    float* oi = out + i * out_stride;
    switch (std::min(n - i, kMaxDots)) {
      case 1: Dots<1>(qi, key, size, scale, oi, out_stride); break;
      case 2: Dots<2>(qi, key, size, scale, oi, out_stride); break;
      case 3: Dots<3>(qi, key, size, scale, oi, out_stride); break;
      case 4: Dots<4>(qi, key, size, scale, oi, out_stride); break;
      case 5: Dots<5>(qi, key, size, scale, oi, out_stride); break;
      case 6: Dots<6>(qi, key, size, scale, oi, out_stride); break;
      case 7: Dots<7>(qi, key, size, scale, oi, out_stride); break;
      default: Dots<8>(qi, key, size, scale, oi, out_stride); break;
    }
  }
}

// Query heads whose weighted sums share one pass over the values: their
// partial sums (4 vectors each) and the value's 4 vectors fit the registers.
constexpr int64_t kSumHeads = kLanes == 16 ? 6 : 2;

// acc[i * H + h] = sum_j p[i * visible + j] * value(j)[h] for i in [0, N),
// h in [h0, h0 + 4 kLanes): each sum over j in slot order from zero, as one
// query's alone, with each value row read once for the N of them.
template <int N, typename ValueFn>
inline void WeightedSums(const float* p, int64_t visible, int64_t cached, ValueFn value,
                         const float* v_rows, int64_t kv_stride, int64_t size, int64_t h0,
                         float* acc) {
  Vec a[N][4];
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < 4; ++c) a[i][c] = Vec{};
  }
  for (int64_t j = 0; j < visible; ++j) {
    if (j + kAheadSlots < cached) {
      PrefetchRow(v_rows + (j + kAheadSlots) * kv_stride + h0, 4 * kLanes);
    }
    const float* v = value(j) + h0;
    const Vec v0 = Load(v), v1 = Load(v + kLanes), v2 = Load(v + 2 * kLanes),
              v3 = Load(v + 3 * kLanes);
    for (int i = 0; i < N; ++i) {
      const float pj = p[i * visible + j];
      a[i][0] += pj * v0;
      a[i][1] += pj * v1;
      a[i][2] += pj * v2;
      a[i][3] += pj * v3;
    }
  }
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < 4; ++c) Store(acc + i * size + h0 + c * kLanes, a[i][c]);
  }
}

// out[h] += p * v[h] for h in [0, size).
inline void Axpy(float p, const float* v, float* out, int64_t size) {
  int64_t h = 0;
  for (; h + kLanes <= size; h += kLanes) Store(out + h, Load(out + h) + p * Load(v + h));
  for (; h < size; ++h) out[h] += p * v[h];
}

typedef int32_t IVec __attribute__((vector_size(4 * kLanes)));

// exp(x) for x <= 0, each lane alone (Cephes' expf polynomial on x - n ln 2,
// scaled by 2^n through the exponent bits; a few ulp from std::exp, and 0
// below -87): the softmax's exponentials a vector at a time, where std::exp
// was a library call per score that held long contexts back.
inline Vec ExpNonPositive(Vec given) {
  const Vec lowest = -87.0f - Vec{};
  const Vec x = given < lowest ? lowest : given;
  const Vec magic = 12582912.0f - Vec{};  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (x * 1.44269504088896341f + magic) - magic;
  const Vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Vec p = 1.9875691500e-4f - Vec{};
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  const Vec scale = reinterpret_cast<const Vec&>(bits);
  return given < lowest ? Vec{} : p * scale;  // below -87 (and -inf): 0
}

template <typename A, typename B>
bool Same(const A& a, const B& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

struct Shapes {
  int64_t b, t, n, k, h, layers, slots, group;
};

// Every query of row `row` on kv head `kv_head`: the G query heads that
// share it, for each of the T new tokens.
void AttendHead(const Shapes& s, int64_t row, int64_t kv_head, int64_t layer, int64_t start,
                const float* q, const float* k_new, const float* v_new, const float* k_cache,
                const float* v_cache, float* out) {
  const int64_t cached = std::clamp<int64_t>(start, 0, s.slots);
  const int64_t kv_stride = s.k * s.h;  // floats from one slot (or new token) to the next
  const float* k_rows = k_cache + ((layer * s.b + row) * s.slots) * kv_stride + kv_head * s.h;
  const float* v_rows = v_cache + ((layer * s.b + row) * s.slots) * kv_stride + kv_head * s.h;
  const float* k_chunk = k_new + row * s.t * kv_stride + kv_head * s.h;
  const float* v_chunk = v_new + row * s.t * kv_stride + kv_head * s.h;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.h));
  std::vector<float> scores(s.group * (cached + s.t));  // [G, visible]
  std::vector<float> acc(s.group * s.h);  // [G, H]
  for (int64_t t = 0; t < s.t; ++t) {
    const int64_t visible = cached + t + 1;
    const float* queries = q + ((row * s.t + t) * s.n + kv_head * s.group) * s.h;  // [G, H]
    for (int64_t j = 0; j < visible; ++j) {
      if (j + kAheadSlots < cached) PrefetchRow(k_rows + (j + kAheadSlots) * kv_stride, s.h);
      const float* key = j < cached ? k_rows + j * kv_stride : k_chunk + (j - cached) * kv_stride;
      DotsAny(s.group, queries, key, s.h, scale, scores.data() + j, visible);
    }
    for (int64_t g = 0; g < s.group; ++g) {
      float* row_scores = scores.data() + g * visible;
      const float top = *std::max_element(row_scores, row_scores + visible);
      // Lanes of kLanes scores, the last padded with -inf (exp 0): the
      // same sums for a query whatever else shares the call.
      Vec lanes = Vec{};
      int64_t j = 0;
      for (; j + kLanes <= visible; j += kLanes) {
        const Vec e = ExpNonPositive(Load(row_scores + j) - top);
        Store(row_scores + j, e);
        lanes += e;
      }
      if (j < visible) {
        float tail[kLanes];
        std::fill(tail, tail + kLanes, -std::numeric_limits<float>::infinity());
        std::copy(row_scores + j, row_scores + visible, tail);
        const Vec e = ExpNonPositive(Load(tail) - top);
        for (int64_t i = 0; j + i < visible; ++i) row_scores[j + i] = e[i];
        lanes += e;
      }
      const float total = SumLanes(lanes);
      const float inv = 1.0f / total;
      for (int64_t j = 0; j < visible; ++j) row_scores[j] *= inv;
    }
    // acc[g, h] = sum_j p[g, j] v_j[h], each sum over j in slot order from
    // zero, a block of h at a time with its partial sums in registers: one
    // pass over j per block and kSumHeads heads (`WeightedSums`), not a load
    // and a store of acc per slot, nor a pass over the values per head.
    auto value = [=](int64_t j) {
      return j < cached ? v_rows + j * kv_stride : v_chunk + (j - cached) * kv_stride;
    };
    int64_t h = 0;
    for (; h + 4 * kLanes <= s.h; h += 4 * kLanes) {
      for (int64_t g = 0; g < s.group; g += kSumHeads) {
        const float* p = scores.data() + g * visible;
        float* a = acc.data() + g * s.h;
        switch (std::min(s.group - g, kSumHeads)) {
          case 1: WeightedSums<1>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
#if defined(__AVX512F__)
          case 2: WeightedSums<2>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
          case 3: WeightedSums<3>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
          case 4: WeightedSums<4>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
          case 5: WeightedSums<5>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
          default: WeightedSums<6>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
#else
          default: WeightedSums<2>(p, visible, cached, value, v_rows, kv_stride, s.h, h, a); break;
#endif
        }
      }
    }
    if (h < s.h) {  // head sizes that are not a multiple of 4 kLanes: the rest in memory
      for (int64_t g = 0; g < s.group; ++g) {
        const float* p = scores.data() + g * visible;
        float* a = acc.data() + g * s.h;
        std::fill(a + h, a + s.h, 0.0f);
        for (int64_t j = 0; j < visible; ++j) Axpy(p[j], value(j) + h, a + h, s.h - h);
      }
    }
    std::copy(acc.begin(), acc.end(), out + ((row * s.t + t) * s.n + kv_head * s.group) * s.h);
  }
}

using Queries = ffi::Buffer<ffi::F32, 4>;  // aliases: the handler macro splits on commas
using Cache = ffi::Buffer<ffi::F32, 5>;
using Starts = ffi::Buffer<ffi::S32, 1>;
using LayerIndex = ffi::Buffer<ffi::S32, 0>;

ffi::Error AttendF32(ffi::ThreadPool pool, Queries q, Queries k_new, Queries v_new, Starts starts,
                     LayerIndex layer, Cache k_cache, Cache v_cache, ffi::Result<Queries> out) {
  const auto qd = q.dimensions();
  const auto kd = k_new.dimensions();
  const auto cd = k_cache.dimensions();
  Shapes s{qd[0], qd[1], qd[2], kd[2], qd[3], cd[0], cd[2], 0};
  const bool ok = s.k > 0 && s.n % s.k == 0 && kd[0] == s.b && kd[1] == s.t && kd[3] == s.h &&
                  Same(v_new.dimensions(), kd) && cd[1] == s.b && cd[3] == s.k && cd[4] == s.h &&
                  Same(v_cache.dimensions(), cd) && starts.dimensions()[0] == s.b &&
                  Same(out->dimensions(), qd);
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "jspec_attend_f32: expected q [B, T, N, H], k_new and v_new [B, T, K, H] with K "
        "dividing N, starts [B], and caches [L, B, S, K, H]");
  }
  const int64_t index = *layer.typed_data();
  if (index < 0 || index >= s.layers) {
    return ffi::Error::InvalidArgument("jspec_attend_f32: layer " + std::to_string(index) +
                                       " outside [0, " + std::to_string(s.layers) + ")");
  }
  s.group = s.n / s.k;
  const int32_t* start = starts.typed_data();
  const float* qp = q.typed_data();
  const float* knp = k_new.typed_data();
  const float* vnp = v_new.typed_data();
  const float* kcp = k_cache.typed_data();
  const float* vcp = v_cache.typed_data();
  float* op = out->typed_data();
  // One task per (row, kv head): each writes its own query heads' outputs.
  jspec_cpu::ForEachPanel(pool, s.b * s.k, [=](int64_t task) {
    const int64_t row = task / s.k;
    AttendHead(s, row, task % s.k, index, start[row], qp, knp, vnp, kcp, vcp, op);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecAttendF32, AttendF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Queries>()
                                  .Arg<Queries>()
                                  .Arg<Queries>()
                                  .Arg<Starts>()
                                  .Arg<LayerIndex>()
                                  .Arg<Cache>()
                                  .Arg<Cache>()
                                  .Ret<Queries>());
