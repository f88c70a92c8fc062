// What the matrix kernels' FFI handlers share (`cpu_kernels.cc`,
// `cpu_int4.cc`): picking one layer's buffer by a layer index, checking a
// several-part call's counts, and the VNNI dot step.

#ifndef JSPEC_CPU_FFI_H_
#define JSPEC_CPU_FFI_H_

#include <cstdint>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jspec_cpu {

namespace ffi = xla::ffi;

// The layer variants: the same products, with the weights picked from one
// buffer per layer by a layer index. A `lax.scan` over layers then calls the
// kernel on weights stored per layer, each read where it lies: slicing a
// stacked weight would copy it first (docs/decisions.md).
using LayerIndex = ffi::Buffer<ffi::S32, 0>;

// run(weights[layer]) as a W, or the error saying the layer is out of range.
template <typename W, typename Run>
ffi::Error WithLayer(const char* name, LayerIndex& layer, ffi::RemainingArgs& weights, Run run) {
  const int64_t i = *layer.typed_data();
  if (i < 0 || i >= static_cast<int64_t>(weights.size())) {
    return ffi::Error::InvalidArgument(std::string(name) + ": layer " + std::to_string(i) +
                                       " outside [0, " + std::to_string(weights.size()) + ")");
  }
  auto w = weights.get<W>(i);
  if (!w.has_value()) return w.error();
  return run(*w);
}

// A several-part call's buffers: count parts of `layers` layers each, one
// buffer per part and layer, and a layer index i in [0, layers).
inline ffi::Error CheckParts(const std::string& name, int64_t count, int64_t layers,
                             int64_t buffers, int64_t i) {
  if (count < 1 || layers < 1 || buffers != count * layers || i < 0 || i >= layers) {
    return ffi::Error::InvalidArgument(
        name + ": expected " + std::to_string(count) + " parts of " + std::to_string(layers) +
        " layers and a layer in [0, " + std::to_string(layers) + "), got " +
        std::to_string(buffers) + " buffers and layer " + std::to_string(i));
  }
  return ffi::Error::Success();
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// acc += dot4(u8 lanes of a, s8 lanes of b), in place. Written as asm
// because GCC 12 copies the accumulator on every `_mm512_dpbusd_epi32`
// (the intrinsic reads as a fresh result), and with 24 accumulators those
// copies spilled to the stack on every step of K (seen in the assembly).
inline __m512i Dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#endif

}  // namespace jspec_cpu

#endif  // JSPEC_CPU_FFI_H_
