// Register tiles over weights stored in panels, for the layer matmuls (cpu_matmul.cc) and the
// many-row path of the quantized ones (cpu_qmatmul.cc, on a panel dequantized into a buffer):
// a panel holds P = kVecs vectors of columns, its rows one after the other, as 32-bit words: f32
// weights, or bf16 pairs (rows 2i and 2i + 1 of the weights, cpu_bf16.h). A tile of R rows x G
// panels keeps R * G * kVecs accumulators in registers over all of K, loading each weight vector
// once and each x word once as a broadcast. Also the activations' rounding to bf16 pairs.

#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 6;  // rows of a tile: 6 x 4 accumulators of 32 registers
#else
constexpr int64_t kMaxRows = 3;  // 3 x 4 of 16
#endif
// Rows of a bf16 tile: as f32's with vdpbf16ps; without it a step widens each weight vector to
// two f32 vectors, which take registers beside the accumulators.
constexpr int64_t kMaxPairRows = JAXSERVE_DPBF16 ? kMaxRows : kMaxRows - 2;
constexpr int64_t kVecs = 4;  // vectors per panel row
constexpr int64_t kPanel = kVecs * kLanes;
constexpr int64_t kPrefetch = 2048;  // words ahead of the stream a tile reads
constexpr int64_t kLineVecs = std::max<int64_t>(1, 64 / (kLanes * sizeof(float)));  // vectors per cache line
constexpr int64_t kLineWords = 64 / sizeof(float);

// The two kinds of weights, both streams of 32-bit words: f32 values, or bf16 pairs.
// `Word` is a weight's (and an activation's) unit; a step of K is one word of each.
struct F32 {
  using Word = float;
  using Lanes = Vec;
  static constexpr int64_t kRows = kMaxRows;
  static Lanes broadcast(float x) { return Vec{} + x; }
  static Lanes load_lanes(const float* p) { return load(p); }
  static void madd(Vec& acc, Lanes a, Lanes b) { acc += a * b; }
};

struct Bf16 {
  using Word = Pairs;
  using Lanes = IVec;
  static constexpr int64_t kRows = kMaxPairRows;
  static Lanes broadcast(Pairs x) { return splat(x); }
  static Lanes load_lanes(const Pairs* p) { return load_pairs(p); }
  static void madd(Vec& acc, Lanes a, Lanes b) { madd_pairs(acc, a, b); }
};

template <typename T>
struct Problem {
  using Word = typename T::Word;
  const Word* x;  // [M, K] words
  const Word* w;  // the layer's panels [N / P, K, P] words
  float* out;     // [M, N]
  int64_t m, k, n;  // k: words of a row of x (bf16: pairs)
};

// out[R rows from `row`, panels [panel, panel + G)] = x[rows] @ those panels. Meanwhile it
// prefetches `ahead_lines` cache lines from `ahead` (weights the thread reads next).
template <typename T, int64_t R, int64_t G>
void tile(const Problem<T>& p, int64_t row, int64_t panel, const typename T::Word* ahead = nullptr,
          int64_t ahead_lines = 0) {
  using Word = typename T::Word;
  Vec acc[R][G][kVecs] = {};
  const Word* x = p.x + row * p.k;
  const Word* w = p.w + panel * p.k * kPanel;
  const int64_t per_step = (ahead_lines + p.k - 1) / p.k;
  for (int64_t i = 0; i < p.k; ++i, w += kPanel) {
    for (int64_t j = i * per_step; j < std::min(ahead_lines, (i + 1) * per_step); ++j) {
      __builtin_prefetch(ahead + j * kLineWords);
    }
    typename T::Lanes b[G][kVecs];
    for (int64_t g = 0; g < G; ++g) {
      const Word* wg = w + g * p.k * kPanel;
      for (int64_t v = 0; v < kVecs; v += kLineVecs) __builtin_prefetch(wg + kPrefetch + v * kLanes);
      for (int64_t v = 0; v < kVecs; ++v) b[g][v] = T::load_lanes(wg + v * kLanes);
    }
    for (int64_t r = 0; r < R; ++r) {
      const auto a = T::broadcast(x[r * p.k + i]);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t v = 0; v < kVecs; ++v) T::madd(acc[r][g][v], a, b[g][v]);
    }
  }
  float* out = p.out + row * p.n + panel * kPanel;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t v = 0; v < kVecs; ++v) store(out + r * p.n + g * kPanel + v * kLanes, acc[r][g][v]);
}

template <typename T, int64_t G, int64_t... R>
void short_tile(const Problem<T>& p, int64_t rows, int64_t row, int64_t panel, std::integer_sequence<int64_t, R...>) {
  ((rows == R + 1 && (tile<T, R + 1, G>(p, row, panel), true)) || ...);
}

// Rows [first, last) of panels [panel, panel + G): tiles of R rows, then the rows left over.
// The first tile streams the panels from memory, the others read them from L2; those others
// prefetch, evenly between them, the panels from `next` (-1: none), so that the memory streams
// them while the multiply-adds run.
template <typename T, int64_t R, int64_t G>
void rows(const Problem<T>& p, int64_t first, int64_t last, int64_t panel, int64_t next = -1) {
  const int64_t later_tiles = std::max<int64_t>(0, (last - first) / R - 1);  // full tiles after the first
  const int64_t lines = next < 0 || later_tiles == 0 ? 0 : G * p.k * kPanel / kLineWords;
  const int64_t per_tile = later_tiles == 0 ? 0 : (lines + later_tiles - 1) / later_tiles;
  const auto* ahead = p.w + std::max<int64_t>(next, 0) * p.k * kPanel;
  int64_t row = first, prefetched = 0;
  for (; row + R <= last; row += R) {
    const int64_t n = row == first ? 0 : std::min(per_tile, lines - prefetched);
    tile<T, R, G>(p, row, panel, ahead + prefetched * kLineWords, n);
    prefetched += n;
  }
  if (row < last) short_tile<T, G>(p, last - row, row, panel, std::make_integer_sequence<int64_t, R - 1>{});
}

// Rows of activations as bf16 pairs [M, ceil(K / 2)] (an odd K's last pair padded with a
// zero), from f32 (rounded to nearest even) or bf16 (`bits`: their bits). Once per call: M * K
// conversions against the M * K * N multiply-adds. The buffer is the calling thread's, kept
// between calls (freeing and mapping it again would cost page faults every call); the call's
// workers read it while the caller waits for them in `parallel_units`.
const Pairs* pair_rows(const float* f32, const uint16_t* bits, int64_t m, int64_t k) {
  thread_local std::vector<Pairs> buffer;
  const int64_t pairs = (k + 1) / 2;
  buffer.resize(m * pairs);
  uint16_t* halves = reinterpret_cast<uint16_t*>(buffer.data());  // little-endian: the first of a pair is low
  for (int64_t r = 0; r < m; ++r) {
    if (f32 != nullptr) {
      pairs_in_order(f32 + r * k, k / 2, buffer.data() + r * pairs);
      if (k % 2) halves[r * 2 * pairs + k - 1] = to_bf16(f32[r * k + k - 1]);
    } else {
      std::copy(bits + r * k, bits + (r + 1) * k, halves + r * 2 * pairs);
    }
    if (k % 2) halves[r * 2 * pairs + k] = 0;
  }
  return buffer.data();
}

const Pairs* pair_rows(const xla::ffi::AnyBuffer& x, int64_t m, int64_t k) {
  if (x.element_type() == xla::ffi::DataType::F32) return pair_rows(x.typed_data<float>(), nullptr, m, k);
  return pair_rows(nullptr, reinterpret_cast<const uint16_t*>(x.untyped_data()), m, k);
}

bool is_f32_or_bf16(const xla::ffi::AnyBuffer& x) {
  return x.element_type() == xla::ffi::DataType::F32 || x.element_type() == xla::ffi::DataType::BF16;
}

}  // namespace
