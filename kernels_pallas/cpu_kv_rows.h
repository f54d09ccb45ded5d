// K/V cache rows of every storage format of kernels_pallas/kv_quant.py, read as f32 by the
// attention kernels (cpu_attention.cc): float (f32), uint16_t (bf16 bits), int8_t (int8 values,
// then the row's f32 scale in 4 bytes), uint8_t (fp8 e4m3 bits, then the scale).
//
// The kernels read a row's values unscaled and apply its scale once per row (to a key's score,
// to a value's softmax weight), so a scaled format costs one multiply per row, not per element.
// bf16 widens to f32 in registers (a 16-bit shift), so products and sums stay f32 exactly as
// with an f32 cache holding the same values.

#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_vector.h"

namespace {

// Elements of a row after its head_dim values: the f32 scale of a one-byte format.
template <typename T>
constexpr int64_t kRowExtra = sizeof(T) == 1 ? 4 : 0;

template <typename T>
constexpr bool kScaled = sizeof(T) == 1;

// fp8 e4m3 ("fn": no infinities, 0x7f / 0xff are NaN) to f32, all 256 bit patterns.
inline std::array<float, 256> fp8_table() {
  std::array<float, 256> table{};
  for (int bits = 0; bits < 256; ++bits) {
    const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
    float magnitude;
    if ((bits & 0x7f) == 0x7f) magnitude = __builtin_nanf("");
    else if (exponent == 0) magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
    else magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    table[bits] = (bits & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

inline const float* fp8_to_f32() {
  static const std::array<float, 256> table = fp8_table();
  return table.data();
}

// One element as f32 (unscaled).
template <typename T>
inline float kv_value(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *p;
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return static_cast<float>(*p);
  } else {
    return fp8_to_f32()[*p];
  }
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
    using I8 = int8_t __attribute__((vector_size(kLanes)));
    I8 b;
    __builtin_memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(b, Vec);
  } else {
    const float* table = fp8_to_f32();
    Vec f;
    for (int64_t i = 0; i < kLanes; ++i) f[i] = table[p[i]];
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

}  // namespace
