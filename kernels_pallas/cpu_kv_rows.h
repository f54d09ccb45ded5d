// K/V cache rows of every storage format of kernels_pallas/kv_quant.py, read as f32 by the
// attention kernels (cpu_attention.cc): float (f32), uint16_t (bf16 bits), int8_t (int8 values,
// then the row's f32 scale in 4 bytes), uint8_t (fp8 e4m3 bits, then the scale).
//
// Decode reads a row's values unscaled and applies its scale once per row (to a key's score, to
// a value's softmax weight); prefill widens a block of rows at a time, scaled (`row_as_f32`).
// bf16 widens to f32 in registers (a 16-bit shift), so products and sums stay f32 exactly as
// with an f32 cache holding the same values.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "cpu_vector.h"

namespace {

// Elements of a row after its head_dim values: the f32 scale of a one-byte format.
template <typename T>
constexpr int64_t kRowExtra = sizeof(T) == 1 ? 4 : 0;

template <typename T>
constexpr bool kScaled = sizeof(T) == 1;

// kLanes bytes widened to int32 lanes, sign- or zero-extended (GCC's generic conversion of a
// byte vector goes element by element).
template <bool Signed>
inline IVec widen_bytes(const void* p) {
  IVec out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i w = Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
#else
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  const __m256i w = Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
#endif
  __builtin_memcpy(&out, &w, sizeof(out));
  return out;
}

// kLanes consecutive elements as f32 (unscaled).
template <typename T>
inline Vec load_kv(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return load(p);
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    using U16 = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
    U16 h;
    __builtin_memcpy(&h, p, sizeof(h));
    const IVec bits = __builtin_convertvector(h, IVec) << 16;
    Vec f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    return f;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return __builtin_convertvector(widen_bytes<true>(p), Vec);
  } else {
    // fp8 e4m3 by its fields: normal numbers rebias the exponent (7 -> 127), subnormals are
    // m * 2^-9. (0x7f / 0xff, NaN, would read as +-480; kv_quant never writes them.)
    const IVec x = widen_bytes<false>(p), magnitude = x & 0x7f;
    const IVec normal = (magnitude << 20) + (120 << 23);
    Vec f;
    __builtin_memcpy(&f, &normal, sizeof(f));
    const Vec subnormal = __builtin_convertvector(magnitude, Vec) * (1.0f / 512.0f);
    f = magnitude < 8 ? subnormal : f;
    IVec bits;
    __builtin_memcpy(&bits, &f, sizeof(bits));
    bits |= (x & 0x80) << 24;
    __builtin_memcpy(&f, &bits, sizeof(f));
    return f;
  }
}

// The scale of a row whose values start at `row` (1 for a format without scales).
template <typename T>
inline float kv_scale(const T* row, int64_t dim) {
  if constexpr (kScaled<T>) {
    float s;
    std::memcpy(&s, row + dim, sizeof(s));
    return s;
  } else {
    return 1.0f;
  }
}

// A row's D values times its scale as f32: the row itself for an f32 cache, else written to
// `scratch` [D].
template <typename T, int64_t D>
inline const float* row_as_f32(const T* row, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const float scale = kv_scale(row, D);
    for (int64_t c = 0; c < D; c += kLanes) store(scratch + c, load_kv(row + c) * scale);
    return scratch;
  }
}

}  // namespace
