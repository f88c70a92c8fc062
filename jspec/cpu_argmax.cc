// jspec's greedy argmax over a row of logits, as an XLA FFI custom call.
//
// XLA's CPU argmax is a (value, index) reduction that runs element by
// element; over a 151936-token vocabulary it cost a few hundred microseconds
// per row, and the speculative loop takes several such argmaxes per round
// (each draft step, each verify position). Here a row is two vector passes:
// the largest value, then the first index that holds it.
//
//   jspec_argmax_f32(x [M, V] f32; limit) -> [M] s32
//
// Each row's result is what `jnp.argmax(where(iota < limit, x, -inf))`
// gives: the first index of the largest value among the first `limit`
// entries, or the first NaN there if one is (XLA's argmax treats NaN as the
// largest); a row of -inf gives 0.

#include <algorithm>
#include <cstdint>
#include <limits>

#include "xla/ffi/api/ffi.h"
#include "cpu_threads.h"

namespace ffi = xla::ffi;

namespace {

using jspec_cpu::ForEachPanel;

#if defined(__AVX512F__)
constexpr int64_t kArgLanes = 16;
#else
constexpr int64_t kArgLanes = 8;
#endif
typedef float ArgVec __attribute__((vector_size(4 * kArgLanes)));
typedef float ArgVecU __attribute__((vector_size(4 * kArgLanes), aligned(4)));  // unaligned
typedef int32_t ArgMask __attribute__((vector_size(4 * kArgLanes)));

inline ArgVec LoadArg(const float* p) { return *reinterpret_cast<const ArgVecU*>(p); }

// The first index of the row's largest value among its first n entries (or
// its first NaN).
int32_t RowArgmax(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  ArgVec best = lowest - ArgVec{};  // every lane -inf
  ArgMask nan = ArgMask{};
  int64_t i = 0;
  for (; i + kArgLanes <= n; i += kArgLanes) {
    const ArgVec v = LoadArg(x + i);
    best = v > best ? v : best;  // a NaN compares false and is passed over here
    nan |= v != v;
  }
  float top = lowest;
  bool any_nan = false;
  for (int64_t lane = 0; lane < kArgLanes; ++lane) {
    top = std::max(top, best[lane]);
    any_nan |= nan[lane] != 0;
  }
  for (int64_t j = i; j < n; ++j) {
    top = x[j] > top ? x[j] : top;
    any_nan |= x[j] != x[j];
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (x[j] != x[j]) return static_cast<int32_t>(j);
    }
  }
  const ArgVec want = top - ArgVec{};
  int64_t j = 0;
  for (; j + kArgLanes <= n; j += kArgLanes) {
    const ArgMask hit = LoadArg(x + j) == want;
    bool any = false;
    for (int64_t lane = 0; lane < kArgLanes; ++lane) any |= hit[lane] != 0;
    if (any) break;
  }
  for (; j < n; ++j) {
    if (x[j] == top) return static_cast<int32_t>(j);
  }
  return 0;  // n == 0 does not reach here: the caller refuses it
}

using Logits = ffi::Buffer<ffi::F32, 2>;
using Ids = ffi::Buffer<ffi::S32, 1>;

ffi::Error Argmax(ffi::ThreadPool pool, Logits x, int64_t limit, ffi::Result<Ids> y) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 1 || yd[0] != xd[0] || xd[1] < 1 ||
      xd[1] > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument(
        "jspec_argmax_f32: expected x [M, V] f32 with 1 <= V < 2^31 and y [M] s32");
  }
  if (limit < 1) {
    return ffi::Error::InvalidArgument("jspec_argmax_f32: expected limit >= 1");
  }
  const float* xp = x.typed_data();
  int32_t* yp = y->typed_data();
  const int64_t v = xd[1], n = std::min(limit, v);
  ForEachPanel(pool, xd[0], [=](int64_t row) { yp[row] = RowArgmax(xp + row * v, n); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecArgmaxF32, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Logits>()
                                  .Attr<int64_t>("limit")
                                  .Ret<Ids>());
