// Matmuls on weight-only quantized kernels for XLA:CPU through the XLA FFI
// (kernels_pallas/cpu_qmatmul.py builds and registers them, and lays the weights out).
//
// out [M, N] = x [M, K] @ W for layer `layer` of a stacked kernel stored as integer codes and
// per-group scales (checkpoints/quant_format.py), in panels of P columns like cpu_matmul.cc's
// f32 weights, so that a tile streams its codes as one contiguous run:
//
//   8 bits: codes int8 [L, N / P, K, P], scale f32 [L, N / P, K / group, P]; w = code * scale.
//   4 bits: codes uint8 [L, N / P, K / 2, P] (row 2i in the low nibble, 2i + 1 in the high),
//           scale and min f16 [L, N / P, K / group, P]; w = code * scale + min.
//
// Few rows (under 24 for 8 bits, 12 for 4): the codes are dequantized in registers, a vector of
// P / kVecs columns at a time, and the products summed in f32: a tile of R rows x G panels keeps
// R * G * kVecs accumulators over all of K, loads a group's scales (and mins) once per group, and
// widens each code vector to f32 once for its R rows (a tile of one or two rows scales each group's
// sums, not each weight: `folded_tile`). Nothing is dequantized in memory: a step streams 1 byte
// (8 bits) or half a byte (4 bits) per weight, against 4 for f32. Many rows: each panel is
// dequantized once per unit of work into a buffer in L2, which the layer matmul's register tiles
// (cpu_panel_tiles.h) read for all the unit's rows (`run_panels`): f32 weights and f32 products, or
// with the `bf16` attribute (a model whose weights are bf16) the weights and x rounded to bf16, the
// bf16 layer matmul's products: as pairs for its AVX512-BF16 dot-product tiles where the CPU runs
// those faster (cpu_bf16.h's `dot_tiles_faster`: AMD's), else as f32 values for the f32 tiles. The code is
// written with the compiler's vector types, so it builds for AVX-512 (16 lanes), AVX2 (8) or
// anything else the compiler targets.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_bf16.h"
#include "cpu_panel_tiles.h"
#include "cpu_parallel.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Panels of kVecs vectors of columns: cpu_panel_tiles.h's kPanel. Rows of a tile on codes:
// R x kVecs accumulators beside a group's kVecs scales and kVecs mins.
#if defined(__AVX512F__)
constexpr int64_t kCodeRows = 4;
#else
constexpr int64_t kCodeRows = 2;
#endif
constexpr int64_t kCodeRowBlock = 4 * kCodeRows;  // rows of a unit of work
constexpr int64_t kCodePrefetch = 1024;  // bytes ahead of the stream a tile reads

using Bytes = uint8_t __attribute__((vector_size(kLanes)));

// f16 -> f32 of one value (the scalar fallback of `load_halves`), subnormals included.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline Vec load_halves(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__) && defined(__AVX__)
  return reinterpret_cast<Vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

template <typename T>
inline T load_bytes(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Unsigned bytes widened to f32 lanes through int32 (a direct conversion of the byte vector
// compiles to one scalar conversion per lane).
inline Vec widen(Bytes bytes) { return __builtin_convertvector(__builtin_convertvector(bytes, IVec), Vec); }

// kLanes int8 codes from `p` as f32 lanes (with the intrinsics: the compilers tried scalarize the
// sign extension of a byte vector).
inline Vec widen_signed(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<Vec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  Vec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<int8_t>(p[i]);
  return v;
#endif
}

// The two storages. A step covers `kStep` rows of K: one code row of the panel (kPanel bytes).
// From `kPanelRows` rows a call dequantizes each panel once (`run_panels`): where that beat the
// register tiles in `python3 -m bench.qmatmul_cpu` (4 bits cost more to unpack per tile than 8).
struct Int8 {
  static constexpr int64_t kStep = 1;
  static constexpr int64_t kPanelRows = 24;
  using Scale = float;
  static Vec scale(const float* p) { return load(p); }
};

struct Int4 {
  static constexpr int64_t kStep = 2;
  static constexpr int64_t kPanelRows = 12;
  using Scale = uint16_t;  // f16 bits
  static Vec scale(const uint16_t* p) { return load_halves(p); }
};

template <typename F>
struct QProblem {
  const float* x;  // [M, K]
  const uint8_t* codes;  // the layer's panels [N / P, K / kStep, P] bytes
  const typename F::Scale* scale;  // [N / P, groups, P]
  const uint16_t* min;  // 4 bits: [N / P, groups, P] f16; else null
  float* out;  // [M, N]
  int64_t m, k, n, group;  // group: rows of K per scale
  bool bf16;  // from F::kPanelRows rows: products of bf16 values (weights and x rounded), not f32's
};

// A tile of one or two rows of outputs (R * G <= 2) with the scales (and mins) applied once per
// group, not per weight: sum_i x_i (c_i s + z) = s sum_i x_i c_i + z sum_i x_i. Each weight then
// costs its widening and one multiply-add, not a scaling besides (at one row, where nothing else
// shares that work, it is most of it); the sums of a group take a second set of R * G * kVecs
// registers, which only small tiles have.
template <typename F, int64_t R, int64_t G>
void folded_tile(const QProblem<F>& p, int64_t row, int64_t panel) {
  Vec acc[R][G][kVecs] = {};
  const float* x = p.x + row * p.k;
  const int64_t groups = p.k / p.group, code_rows = p.k / F::kStep;
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t first = grp * p.group, last = first + p.group;
    Vec part[R][G][kVecs] = {};
    for (int64_t i = first; i < last; i += F::kStep) {
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* c = p.codes + ((panel + g) * code_rows + i / F::kStep) * kPanel;
        __builtin_prefetch(c + kCodePrefetch);
        for (int64_t v = 0; v < kVecs; ++v) {
          if constexpr (F::kStep == 1) {
            const Vec w = widen_signed(c + v * kLanes);
            for (int64_t r = 0; r < R; ++r) part[r][g][v] += x[r * p.k + i] * w;
          } else {
            const Bytes b = load_bytes<Bytes>(c + v * kLanes);
            const Vec lo = widen(b & 15), hi = widen(b >> 4);
            for (int64_t r = 0; r < R; ++r) part[r][g][v] += x[r * p.k + i] * lo + x[r * p.k + i + 1] * hi;
          }
        }
      }
    }
    float xsum[R] = {};
    if (p.min != nullptr) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = first; i < last; ++i) xsum[r] += x[r * p.k + i];
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = ((panel + g) * groups + grp) * kPanel;
      for (int64_t v = 0; v < kVecs; ++v) {
        const Vec s = F::scale(p.scale + at + v * kLanes);
        const Vec z = p.min == nullptr ? Vec{} : load_halves(p.min + at + v * kLanes);
        for (int64_t r = 0; r < R; ++r) acc[r][g][v] += part[r][g][v] * s + xsum[r] * z;
      }
    }
  }
  float* out = p.out + row * p.n + panel * kPanel;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t v = 0; v < kVecs; ++v) store(out + r * p.n + g * kPanel + v * kLanes, acc[r][g][v]);
}

// out[R rows from `row`, panels [panel, panel + G)] = x[rows] @ those panels' dequantized weights.
template <typename F, int64_t R, int64_t G>
void code_tile(const QProblem<F>& p, int64_t row, int64_t panel) {
  if constexpr (R * G <= 2) {
    folded_tile<F, R, G>(p, row, panel);
    return;
  }
  Vec acc[R][G][kVecs] = {};
  const float* x = p.x + row * p.k;
  const int64_t groups = p.k / p.group, code_rows = p.k / F::kStep;
  for (int64_t grp = 0; grp < groups; ++grp) {
    Vec s[G][kVecs], z[G][kVecs];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = ((panel + g) * groups + grp) * kPanel;
      for (int64_t v = 0; v < kVecs; ++v) {
        s[g][v] = F::scale(p.scale + at + v * kLanes);
        z[g][v] = p.min == nullptr ? Vec{} : load_halves(p.min + at + v * kLanes);
      }
    }
    for (int64_t i = grp * p.group; i < (grp + 1) * p.group; i += F::kStep) {
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* c = p.codes + ((panel + g) * code_rows + i / F::kStep) * kPanel;
        __builtin_prefetch(c + kCodePrefetch);
        for (int64_t v = 0; v < kVecs; ++v) {
          if constexpr (F::kStep == 1) {
            const Vec w = widen_signed(c + v * kLanes) * s[g][v];
            for (int64_t r = 0; r < R; ++r) acc[r][g][v] += x[r * p.k + i] * w;
          } else {
            const Bytes b = load_bytes<Bytes>(c + v * kLanes);
            const Vec lo = widen(b & 15) * s[g][v] + z[g][v];
            for (int64_t r = 0; r < R; ++r) acc[r][g][v] += x[r * p.k + i] * lo;
            const Vec hi = widen(b >> 4) * s[g][v] + z[g][v];
            for (int64_t r = 0; r < R; ++r) acc[r][g][v] += x[r * p.k + i + 1] * hi;
          }
        }
      }
    }
  }
  float* out = p.out + row * p.n + panel * kPanel;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t v = 0; v < kVecs; ++v) store(out + r * p.n + g * kPanel + v * kLanes, acc[r][g][v]);
}

template <typename F, int64_t G, int64_t... R>
void short_code_tile(const QProblem<F>& p, int64_t rows, int64_t row, int64_t panel, std::integer_sequence<int64_t, R...>) {
  ((rows == R + 1 && (code_tile<F, R + 1, G>(p, row, panel), true)) || ...);
}

// Rows [first, last) of panels [panel, panel + G): tiles of R rows, then the rows left over.
template <typename F, int64_t R, int64_t G>
void code_rows(const QProblem<F>& p, int64_t first, int64_t last, int64_t panel) {
  int64_t row = first;
  for (; row + R <= last; row += R) code_tile<F, R, G>(p, row, panel);
  if (row < last) short_code_tile<F, G>(p, last - row, row, panel, std::make_integer_sequence<int64_t, R - 1>{});
}

// Units of a group of G panels by a block of rows (panel-group major, so that consecutive units
// read the same codes, from L2 after the first), split over XLA's intra-op threads. An odd last
// panel of a two-panel call is a group of one.
template <typename F, int64_t R, int64_t G>
void run_codes(ffi::ThreadPool& pool, const QProblem<F>& p) {
  const int64_t panels = p.n / kPanel, groups = (panels + G - 1) / G;
  const int64_t blocks = (p.m + kCodeRowBlock - 1) / kCodeRowBlock;
  const int64_t cost = (p.m + 16) * p.k * p.n;
  parallel_units(pool, groups * blocks, cost, [p, panels, blocks](int64_t u) {
    const int64_t first = u % blocks * kCodeRowBlock, last = std::min(first + kCodeRowBlock, p.m), panel = u / blocks * G;
    if (panel + G <= panels) {
      code_rows<F, R, G>(p, first, last, panel);
    } else {
      code_rows<F, R, 1>(p, first, last, panel);
    }
  });
}

// ----- Many rows: each panel dequantized once into a scratch buffer ----------------------------
//
// Above, every tile dequantizes its panel's codes again for its R rows: at many rows that costs
// more than the multiply-adds (4 bits: a widening, a multiply and an add per weight for R = 4
// multiply-adds). From F::kPanelRows rows a unit of work dequantizes its panel once into a buffer
// of the thread's, in the layout of the layer matmul's panels (cpu_panel_tiles.h): f32 [K, P]
// (K = 1536: 384 KB, within L2; in a bf16 model each value rounded to bf16), or bf16 pairs
// [ceil(K / 2), P] (half that), and runs that matmul's register tiles over all its rows against
// it, as it does on its own panels.

constexpr int64_t kMinPanelBlock = 32;  // fewest rows a unit dequantizes a panel for (but a call's all)

// The scales (and mins) of group `grp` of panel `panel`, vector `v` (no mins: zeros).
template <typename F>
void group_scales(const QProblem<F>& p, int64_t panel, int64_t grp, Vec (&s)[kVecs], Vec (&z)[kVecs]) {
  const int64_t at = (panel * (p.k / p.group) + grp) * kPanel;
  for (int64_t v = 0; v < kVecs; ++v) {
    s[v] = F::scale(p.scale + at + v * kLanes);
    z[v] = p.min == nullptr ? Vec{} : load_halves(p.min + at + v * kLanes);
  }
}

// Panel `panel` of the layer as f32 weights [K, P] into `w`; `round`: each rounded to bf16.
template <typename F>
void dequantize_panel(const QProblem<F>& p, int64_t panel, float* w, bool round) {
  auto put = [round](float* at, Vec v) { store(at, round ? bf16_values(v) : v); };
  const uint8_t* codes = p.codes + panel * (p.k / F::kStep) * kPanel;
  for (int64_t grp = 0; grp < p.k / p.group; ++grp) {
    Vec s[kVecs], z[kVecs];
    group_scales(p, panel, grp, s, z);
    for (int64_t i = grp * p.group; i < (grp + 1) * p.group; i += F::kStep) {
      const uint8_t* c = codes + i / F::kStep * kPanel;
      float* out = w + i * kPanel;
      for (int64_t v = 0; v < kVecs; ++v) {
        if constexpr (F::kStep == 1) {
          put(out + v * kLanes, widen_signed(c + v * kLanes) * s[v]);
        } else {
          const Bytes b = load_bytes<Bytes>(c + v * kLanes);
          put(out + v * kLanes, widen(b & 15) * s[v] + z[v]);
          put(out + kPanel + v * kLanes, widen(b >> 4) * s[v] + z[v]);
        }
      }
    }
  }
}

// Panel `panel` of the layer as bf16 pairs [ceil(K / 2), P] into `w` (rows 2i and 2i + 1 of the
// weights, each dequantized in f32 and rounded to bf16; an odd K's last pair padded with a zero).
// A 4-bit code row is one such pair already (groups are even); 8 bits pair two code rows, whose
// groups may differ (an odd group), so each takes its own scale.
template <typename F>
void dequantize_panel(const QProblem<F>& p, int64_t panel, Pairs* w) {
  const uint8_t* codes = p.codes + panel * (p.k / F::kStep) * kPanel;
  if constexpr (F::kStep == 2) {
    for (int64_t grp = 0; grp < p.k / p.group; ++grp) {
      Vec s[kVecs], z[kVecs];
      group_scales(p, panel, grp, s, z);
      for (int64_t i = grp * p.group / 2; i < (grp + 1) * p.group / 2; ++i) {
        for (int64_t v = 0; v < kVecs; ++v) {
          const Bytes b = load_bytes<Bytes>(codes + i * kPanel + v * kLanes);
          store_pairs(w + i * kPanel + v * kLanes, pair_lanes(widen(b & 15) * s[v] + z[v], widen(b >> 4) * s[v] + z[v]));
        }
      }
    }
  } else {
    const typename F::Scale* scales = p.scale + panel * (p.k / p.group) * kPanel;
    auto row = [&](int64_t i, int64_t v) {
      if (i >= p.k) return Vec{};
      return widen_signed(codes + i * kPanel + v * kLanes) * F::scale(scales + i / p.group * kPanel + v * kLanes);
    };
    for (int64_t i = 0; i < (p.k + 1) / 2; ++i)
      for (int64_t v = 0; v < kVecs; ++v) store_pairs(w + i * kPanel + v * kLanes, pair_lanes(row(2 * i, v), row(2 * i + 1, v)));
  }
}

// Units of a panel by a block of rows (panel major), enough of them to keep every thread busy
// but no block under kMinPanelBlock rows; each dequantizes its panel into its thread's buffer
// (kept between calls: mapping it again would cost page faults every call) and runs the layer
// matmul's tiles over its rows. `x`: the rows as that matmul's words (T: F32 or Bf16), `k` words
// each; `round`: f32 weights rounded to bf16 (bf16 pairs always are).
template <typename T, typename F>
void run_panels(ffi::ThreadPool& pool, const QProblem<F>& p, const typename T::Word* x, int64_t k, bool round) {
  const int64_t panels = p.n / kPanel, workers = pool.num_threads() + 1;
  const int64_t wanted = (4 * workers + panels - 1) / panels;  // row blocks for ~4 units per thread
  const int64_t blocks = std::max<int64_t>(1, std::min(wanted, p.m / kMinPanelBlock));
  const int64_t block = (p.m + blocks - 1) / blocks;
  parallel_units(pool, panels * blocks, (p.m + 16) * p.k * p.n, [p, x, k, round, blocks, block](int64_t u) {
    thread_local std::vector<typename T::Word> buffer;
    buffer.resize(k * kPanel);
    const int64_t panel = u / blocks, first = u % blocks * block, last = std::min(first + block, p.m);
    if constexpr (std::is_same_v<T, F32>) {
      dequantize_panel(p, panel, buffer.data(), round);
    } else {
      dequantize_panel(p, panel, buffer.data());
    }
    const Problem<T> unit{x, buffer.data(), p.out + panel * kPanel, p.m, k, p.n};  // the panel alone
    rows<T, T::kRows, 1>(unit, first, last, 0);
  });
}

// x [M, K] rounded to bf16, as f32 values, in the calling thread's buffer (kept between calls, as
// `pair_rows`'s; the call's workers read it while the caller waits for them).
const float* bf16_rows(const float* x, int64_t n) {
  thread_local std::vector<float> buffer;
  buffer.resize(n);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(buffer.data() + i, bf16_values(load(x + i)));
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(to_bf16(x[i])) << 16;
    std::memcpy(&buffer[i], &bits, sizeof(bits));
  }
  return buffer.data();
}

// A call of one row takes two panels at once, so that its tile has enough accumulators to hide
// the latency of its multiply-adds; from F::kPanelRows rows each panel is dequantized once. With
// `bf16` the weights and x are rounded to bf16: as pairs for the dot-product tiles where this CPU
// runs them faster (`dot_tiles_faster`), else as f32 values for the f32 tiles.
template <typename F>
void run_layer(ffi::ThreadPool& pool, const QProblem<F>& p) {
  if (p.m == 1) {
    run_codes<F, 1, 2>(pool, p);
  } else if (p.m < F::kPanelRows) {
    run_codes<F, kCodeRows, 1>(pool, p);
  } else if (p.bf16 && dot_tiles_faster()) {
    run_panels<Bf16>(pool, p, pair_rows(p.x, nullptr, p.m, p.k), (p.k + 1) / 2, true);
  } else {
    run_panels<F32>(pool, p, p.bf16 ? bf16_rows(p.x, p.m * p.k) : p.x, p.k, p.bf16);
  }
}

// Checks the shapes shared by both storages: x [M, K], codes [L, N / P, K / step, P], scales
// [L, N / P, groups, P] with K a multiple of the groups (and of a group, of the step).
ffi::Error check(const ffi::Buffer<ffi::F32>& x, ffi::Span<const int64_t> cd, ffi::Span<const int64_t> sd,
                 int64_t step, int64_t layer) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || cd.size() != 4 || sd.size() != 4 || cd[3] != kPanel || sd[3] != kPanel ||
      sd[0] != cd[0] || sd[1] != cd[1] || cd[2] * step != xd[1] || sd[2] <= 0 || xd[1] % sd[2] != 0 ||
      (xd[1] / sd[2]) % step != 0) {
    return ffi::Error::InvalidArgument(
        "quantized layer matmul: x [M, K], codes [L, N / P, K / step, P] and scales [L, N / P, groups, P] of this "
        "kernel's P");
  }
  if (layer < 0 || layer >= cd[0]) return ffi::Error::InvalidArgument("quantized layer matmul: layer out of range");
  return ffi::Error::Success();
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                          bool bf16) {
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  const int64_t l = layer.typed_data()[0];
  if (auto error = check(x, cd, sd, 1, l); error.failure()) return error;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  if (m == 0 || cd[1] == 0) return ffi::Error::Success();
  const QProblem<Int8> p{x.typed_data(), reinterpret_cast<const uint8_t*>(codes.typed_data()) + l * cd[1] * cd[2] * kPanel,
                        scale.typed_data() + l * sd[1] * sd[2] * kPanel, nullptr, out->typed_data(), m, k,
                        cd[1] * kPanel, k / sd[2], bf16};
  run_layer(pool, p);
  return ffi::Error::Success();
}

ffi::Error Int4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                          ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> min, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out, bool bf16) {
  const auto cd = codes.dimensions();
  const auto sd = scale.dimensions();
  const auto md = min.dimensions();
  const int64_t l = layer.typed_data()[0];
  if (auto error = check(x, cd, sd, 2, l); error.failure()) return error;
  if (!std::equal(sd.begin(), sd.end(), md.begin(), md.end())) {
    return ffi::Error::InvalidArgument("quantized layer matmul: scales and mins of different shapes");
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  if (m == 0 || cd[1] == 0) return ffi::Error::Success();
  const int64_t scales = l * sd[1] * sd[2] * kPanel;
  const QProblem<Int4> p{x.typed_data(), codes.typed_data() + l * cd[1] * cd[2] * kPanel,
                        reinterpret_cast<const uint16_t*>(scale.untyped_data()) + scales,
                        reinterpret_cast<const uint16_t*>(min.untyped_data()) + scales, out->typed_data(), m, k,
                        cd[1] * kPanel, k / sd[2], bf16};
  run_layer(pool, p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()  // codes, panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales, panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("bf16"));  // products of bf16 values from F::kPanelRows rows

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt4Matmul, Int4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()  // codes, two a byte, panels
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scales, panels
                                  .Arg<ffi::Buffer<ffi::F16>>()  // mins, panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("bf16"));  // products of bf16 values from F::kPanelRows rows

extern "C" int64_t JaxserveQMatmulPanel() { return kPanel; }

// The fewest rows from which a call of `bits`-bit codes dequantizes each panel into a buffer (and
// with the `bf16` attribute multiplies bf16 values).
extern "C" int64_t JaxserveQMatmulPanelRows(int64_t bits) { return bits == 8 ? Int8::kPanelRows : Int4::kPanelRows; }
