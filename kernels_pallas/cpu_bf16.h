// bfloat16 for the CPU kernels (cpu_matmul.cc): pairs of bf16 values held in 32-bit words,
// the first of a pair in the low half (the order of AVX512-BF16's dot products), and a
// multiply-add of a vector of such pairs into f32 lanes:
//   acc[i] += a.lo[i] * b.lo[i] + a.hi[i] * b.hi[i].
// With AVX512-BF16 (built with -march=native on a CPU that has it) that is one vdpbf16ps;
// elsewhere each half is widened to f32 (a shift or a mask: a bf16 value is the top half of an
// f32) and multiplied there. A product of two bf16 values is exact in f32, so both compute the
// same products and differ only in the rounding of the two additions into the accumulator.

#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_vector.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define JAXSERVE_DPBF16 1
#else
#define JAXSERVE_DPBF16 0
#endif

namespace {

using Pairs = uint32_t;  // two bf16 values, the first in the low half

// f32 -> bf16 rounded to nearest even (what XLA's convert and AVX512-BF16's do); NaN stays NaN.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline Vec lo_half(IVec w) { return reinterpret_cast<Vec>(w << 16); }
inline Vec hi_half(IVec w) { return reinterpret_cast<Vec>(w & static_cast<int32_t>(0xffff0000u)); }

inline IVec splat(Pairs w) { return IVec{} + static_cast<int32_t>(w); }

inline IVec load_pairs(const Pairs* p) {
  IVec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// acc += a.lo * b.lo + a.hi * b.hi, lane by lane (see the top of the file).
inline void madd_pairs(Vec& acc, IVec a, IVec b) {
#if JAXSERVE_DPBF16
  acc = reinterpret_cast<Vec>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(a),
                                               reinterpret_cast<__m512bh>(b)));
#else
  acc += lo_half(a) * lo_half(b);
  acc += hi_half(a) * hi_half(b);
#endif
}

}  // namespace
