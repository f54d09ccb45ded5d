// What both attention kernels of cpu_attention.cc share: the vector exp and tanh, the dispatch on
// head_dim and on the cache's element type (cpu_kv_rows.h), shape checks and the offsets of a
// sequence's rows in its pages.

#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_kv_rows.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kDimStep = 16;  // head_dim is a multiple of this (the dispatch's unit)
constexpr float kMasked = -1e30f;  // finite: a fully masked key block must not give inf - inf

// e^x for each lane (Cephes' range reduction and polynomial; ~1 ulp for x in [-87, 88]).
inline Vec exp(Vec x) {
  const Vec lo = x < -87.0f ? Vec{} - 87.0f : x;
  x = lo > 88.0f ? Vec{} + 88.0f : lo;
  const Vec t = x * 1.44269504088896341f;
  const IVec n = __builtin_convertvector(t + (t >= 0.0f ? Vec{} + 0.5f : Vec{} - 0.5f), IVec);
  const Vec nf = __builtin_convertvector(n, Vec);
  Vec r = x - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IVec bits = (n + 127) << 23;
  Vec scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline Vec tanh(Vec x) { return 1.0f - 2.0f / (exp(2.0f * x) + 1.0f); }

template <typename F, size_t... I>
bool dispatch(int64_t chunks, F&& f, std::index_sequence<I...>) {
  return ((chunks == static_cast<int64_t>(I) + 1 && (f(std::integral_constant<int64_t, I + 1>{}), true)) || ...);
}

// Calls f(std::integral_constant<int64_t, C>{}) with C = dim / 16 for a dim that is a multiple
// of 16 up to 256 (the kernels are specialized on it); false for any other dim.
template <typename F>
bool with_head_dim(int64_t dim, F&& f) {
  return dim % kDimStep == 0 && dispatch(dim / kDimStep, f, std::make_index_sequence<16>{});
}

// Calls f(T{}) with T the element type of a cache of `type` (cpu_kv_rows.h), and gives the
// elements a row has after its head_dim values; false for a type no format stores.
template <typename F>
bool with_kv_type(ffi::DataType type, int64_t& row_extra, F&& f) {
  switch (type) {
    case ffi::DataType::F32: row_extra = kRowExtra<float>; f(float{}); return true;
    case ffi::DataType::BF16:  // the same bits as the CPU's uint16 store
    case ffi::DataType::U16: row_extra = kRowExtra<uint16_t>; f(uint16_t{}); return true;
    case ffi::DataType::S8: row_extra = kRowExtra<int8_t>; f(int8_t{}); return true;
    case ffi::DataType::U8: row_extra = kRowExtra<uint8_t>; f(uint8_t{}); return true;
    default: return false;
  }
}

// Whether the caches' shapes and types agree, rows of dim values plus `row_extra`.
bool caches_match(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, int64_t dim, int64_t row_extra) {
  const auto kd = k.dimensions(), vd = v.dimensions();
  return kd.size() == 5 && k.element_type() == v.element_type() && kd[4] == dim + row_extra &&
         std::equal(kd.begin(), kd.end(), vd.begin(), vd.end());
}

// Whether sequence `row`'s block-table entries that cover `length` tokens are pages of the cache.
bool pages_in_range(const int32_t* tables, int64_t width, int64_t block_size, int64_t pages, int64_t row,
                    int64_t length) {
  for (int64_t i = 0; i * block_size < length; ++i) {
    const int32_t page = tables[row * width + i];
    if (page < 0 || page >= pages) return false;
  }
  return true;
}

// Offsets (in elements, within one (layer, kv head) slice of the cache, of rows of `row`
// elements) of a sequence's tokens [first, last), whose block table is `table`: a page at a time,
// no division per token.
void token_offsets(const int32_t* table, int64_t block_size, int64_t row, int64_t first, int64_t last,
                   std::vector<int64_t>& out) {
  out.resize(last - first);
  int64_t page = first / block_size, offset = first % block_size;
  for (int64_t t = 0; t < last - first; ++t) {
    out[t] = (table[page] * block_size + offset) * row;
    if (++offset == block_size) offset = 0, ++page;
  }
}

}  // namespace
