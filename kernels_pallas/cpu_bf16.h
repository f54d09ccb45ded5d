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

// Lane by lane, bf16(f[i]) (rounded as `to_bf16`) in the low half of a 32-bit lane.
inline IVec bf16_lanes(Vec f) {
  using UVec = uint32_t __attribute__((vector_size(sizeof(Vec))));
  const UVec u = reinterpret_cast<UVec>(f);
  const UVec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return reinterpret_cast<IVec>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

// Lane by lane, f[i] rounded to bf16 (as `to_bf16`), as an f32 value.
inline Vec bf16_values(Vec f) { return reinterpret_cast<Vec>(bf16_lanes(f) << 16); }

// Whether this CPU multiplies bf16 values faster with AVX512-BF16 dot products on pairs than with
// f32 FMAs on the values (rounded to bf16, held as f32; the products are exact either way, so the
// two differ only in the order of the f32 sums): AMD's (Zen 4 and 5: a vdpbf16ps does twice an
// FMA's multiply-adds in the same time), not Intel's, which issue it on one port against two for
// FMAs (in these kernels' tiles it measured 0.65x an f32 tile's rate: docs/performance.md, "bf16
// products at many rows"). -DJAXSERVE_BF16_DOT_TILES=0 or 1 decides at build time instead.
inline bool dot_tiles_faster() {
#if defined(JAXSERVE_BF16_DOT_TILES)
  return JAXSERVE_BF16_DOT_TILES && JAXSERVE_DPBF16;
#elif JAXSERVE_DPBF16
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return false;
#endif
}

// Lane by lane, the pair (lo[i], hi[i]) rounded to bf16: a vector of pairs from two vectors of
// f32 (two rows of a matrix whose columns run along the lanes). With AVX512-BF16 one conversion
// rounds both (lo's halves in the low 256 bits, hi's in the high) and a permute interleaves them.
inline IVec pair_lanes(Vec lo, Vec hi) {
#if JAXSERVE_DPBF16 && defined(__AVX512BW__)
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512bh both = _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(hi), reinterpret_cast<__m512>(lo));
  return reinterpret_cast<IVec>(
      _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), reinterpret_cast<__m512i>(both)));
#else
  return bf16_lanes(lo) | (bf16_lanes(hi) << 16);
#endif
}

// out[e] = the pair (f[2e], f[2e + 1]) rounded to bf16, for e < n: pairs of consecutive values.
inline void pairs_in_order(const float* f, int64_t n, Pairs* out) {
  int64_t e = 0;
#if JAXSERVE_DPBF16
  for (; e + kLanes <= n; e += kLanes) {  // 2 kLanes values in order are kLanes pairs
    const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 2 * e + kLanes), _mm512_loadu_ps(f + 2 * e));
    _mm512_storeu_si512(out + e, reinterpret_cast<__m512i>(w));
  }
#endif
  for (; e < n; ++e) out[e] = static_cast<Pairs>(to_bf16(f[2 * e])) | static_cast<Pairs>(to_bf16(f[2 * e + 1])) << 16;
}

// Lane by lane, the pair (lo[i], hi[i]) of bf16 values given as their bits.
inline IVec pair_bits(const uint16_t* lo, const uint16_t* hi) {
  using U16 = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  U16 a, b;
  __builtin_memcpy(&a, lo, sizeof(a));
  __builtin_memcpy(&b, hi, sizeof(b));
  return __builtin_convertvector(a, IVec) | (__builtin_convertvector(b, IVec) << 16);
}

inline void store_pairs(Pairs* p, IVec w) { __builtin_memcpy(p, &w, sizeof(w)); }

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
