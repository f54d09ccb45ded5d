// Matmuls for XLA:CPU through the XLA FFI (kernels_pallas/cpu_matmul.py builds and registers
// them, and lays the weights out): activations with one layer of stacked weights stored in
// panels, and with the embedding as the tied output head (at the end of the file); each with
// f32 weights or bf16 ones (cpu_bf16.h), accumulating in f32.
//
// Layer: out [M, N] = x [M, K] @ W for layer `layer` of w [L, N / P, K, P]: panel j holds columns
// [j * P, (j + 1) * P) of the layer's [K, N] weights, row after row, so a tile reads its weights
// as one contiguous stream (in the [K, N] layout a narrow column block is K short pieces N floats
// apart, which the memory system serves at half its speed, and XLA:CPU's scanned layer loop
// copies a layer's slice before its dot). P is kVecs vector registers wide. A tile of R rows x G
// panels keeps R * G * kVecs accumulators in registers over all of K, loading each weight vector
// once and each x value once as a broadcast; the weights of a panel stay in L2 while the row
// tiles of its row block walk them. Units of work (a panel group by a row block; for a call of
// few rows, consecutive panel groups with all the rows) are split over XLA's intra-op threads.
//
// bf16 weights: w [L, N / P, K / 2, P, 2] (K padded to even with a zero row), panels whose row i
// holds rows 2i and 2i + 1 of the weights as bf16 pairs, one 32-bit word per column: the same
// stream of 32-bit words as the f32 panels over K / 2 steps, each step a multiply-add of pairs
// (`madd_pairs`). The activations are rounded to bf16 pairs once per call (`PairRows`), so a
// broadcast word is a pair of x values. Half the weight bytes of f32, and with AVX512-BF16 half
// the instructions per multiply-add.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_bf16.h"
#include "cpu_panel_tiles.h"
#include "cpu_parallel.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kHeadRows = 4;  // output head: rows x embedding rows = kLanes accumulators
#else
constexpr int64_t kHeadRows = 2;
#endif
constexpr int64_t kRowBlock = 4 * kMaxRows;  // rows of a unit of work (see `run` for calls of few rows)
constexpr int64_t kFewRows = 64;  // a call of at most this many rows may take them all in one unit

// Rows [first, last) of the G panels from `panel`, or of that panel alone when it is the odd
// one of a two-panel call; `next`: the panel group to prefetch meanwhile (see `rows`).
template <typename T, int64_t R, int64_t G>
void group(const Problem<T>& p, int64_t first, int64_t last, int64_t panel, int64_t next = -1) {
  if (panel + G <= p.n / kPanel) {
    rows<T, R, G>(p, first, last, panel, next);
  } else {
    rows<T, R, 1>(p, first, last, panel);
  }
}

// Tiles of R rows by G panels, in units of a panel group by a row block (panel group major, so
// consecutive units share their weights in L2). A call of few rows whose panel groups alone give
// each thread two units or more takes all its rows for each panel group: each panel is then
// streamed from memory by one thread, where row blocks on two threads would each stream it (at
// 32 rows, a 24-row and an 8-row block read the weights twice); and its units are runs of
// consecutive panel groups, each group prefetching the next while its later tiles compute. A
// call of one row takes two panels at once, so that its tile has enough accumulators to hide
// the latency of its multiply-adds.
template <typename T, int64_t R, int64_t G>
void run(ffi::ThreadPool& pool, const Problem<T>& p) {
  const int64_t panels = p.n / kPanel, groups = (panels + G - 1) / G, workers = pool.num_threads() + 1;
  const int64_t cost = (p.m + 16) * p.k * p.n;
  if (p.m <= kFewRows && groups >= 2 * workers) {
    // Units of `chunk` consecutive panel groups (two units per worker or more).
    const int64_t chunk = groups / (2 * workers);
    parallel_units(pool, (groups + chunk - 1) / chunk, cost, [p, panels, groups, chunk](int64_t u) {
      const int64_t end = std::min(groups, (u + 1) * chunk);
      for (int64_t g = u * chunk; g < end; ++g) {
        group<T, R, G>(p, 0, p.m, g * G, g + 1 < end && (g + 2) * G <= panels ? (g + 1) * G : -1);
      }
    });
    return;
  }
  const int64_t blocks = (p.m + kRowBlock - 1) / kRowBlock;
  parallel_units(pool, groups * blocks, cost, [p, blocks](int64_t u) {
    const int64_t first = u % blocks * kRowBlock;
    group<T, R, G>(p, first, std::min(first + kRowBlock, p.m), u / blocks * G);
  });
}

template <typename T>
void run_layer(ffi::ThreadPool& pool, const Problem<T>& p) {
  if (p.m == 1) {
    run<T, 1, 2>(pool, p);
  } else {
    run<T, T::kRows, 1>(pool, p);
  }
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != xd[1] || wd[3] != kPanel) {
    return ffi::Error::InvalidArgument("layer matmul: x [M, K] and panels w [L, N / P, K, P] of this kernel's P");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer matmul: layer out of range");
  const int64_t layer_size = wd[1] * wd[2] * wd[3];
  const Problem<F32> p{x.typed_data(), w.typed_data() + l * layer_size, out->typed_data(), xd[0], xd[1], wd[1] * kPanel};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  run_layer(pool, p);
  return ffi::Error::Success();
}

// x f32 or bf16 [M, K]; w bf16 [L, N / P, ceil(K / 2), P, 2] (see the top of the file).
ffi::Error LayerMatmulBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> w,
                               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (!is_f32_or_bf16(x) || xd.size() != 2 || wd.size() != 5 || wd[2] != (xd[1] + 1) / 2 || wd[3] != kPanel ||
      wd[4] != 2) {
    return ffi::Error::InvalidArgument(
        "bf16 layer matmul: x f32 or bf16 [M, K] and bf16 panels w [L, N / P, ceil(K / 2), P, 2] of this kernel's P");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer matmul: layer out of range");
  const int64_t m = xd[0], pairs = wd[2];
  if (m == 0 || wd[1] == 0) return ffi::Error::Success();
  const Pairs* panels = reinterpret_cast<const Pairs*>(w.untyped_data()) + l * wd[1] * pairs * kPanel;
  const Problem<Bf16> p{pair_rows(x, m, xd[1]), panels, out->typed_data(), m, pairs, wd[1] * kPanel};
  run_layer(pool, p);
  return ffi::Error::Success();
}

// The output head tied to the embedding: out [M, V] = x [M, K] @ e [V, K]^T, K a multiple of
// kLanes words. Each output is a dot product of two rows, so a tile of R rows of x by C rows of e
// (R * C = kLanes) accumulates a vector per pair over K and ends with one transpose_sum. Tiles
// at the edges repeat the last row of x or e and store only their own outputs. With a bf16
// embedding the rows are streams of bf16 pairs (x rounded to them once per call): the lanes of
// a product sum two values of K each, and transpose_sum adds the lanes as before.
template <typename T>
struct Head {
  using Word = typename T::Word;
  const Word* x;
  const Word* e;
  float* out;
  int64_t m, k, v;  // k: words of a row
};

constexpr int64_t kHeadBlock = 64;  // embedding rows of a unit of work

template <typename T, int64_t R, int64_t C>
void head_tile(const Head<T>& p, int64_t row, int64_t col) {
  static_assert(R * C == kLanes);
  using Word = typename T::Word;
  const Word* x[R];
  const Word* e[C];
  for (int64_t r = 0; r < R; ++r) x[r] = p.x + std::min(row + r, p.m - 1) * p.k;
  for (int64_t c = 0; c < C; ++c) e[c] = p.e + std::min(col + c, p.v - 1) * p.k;
  // The first row tile of a column block streams the embedding rows of the next block into the
  // cache meanwhile (they follow its own in memory), a line of them per line it reads: its C rows
  // are C streams a row apart, more than the hardware prefetchers follow at one row of x.
  const Word* next = row == 0 ? p.e + (col + C) * p.k : nullptr;
  Vec acc[kLanes] = {};
  for (int64_t i = 0; i < p.k; i += kLanes) {
    if (next != nullptr && col + 2 * C <= p.v) {
      for (int64_t c = 0; c < C; ++c) __builtin_prefetch(next + (i / kLanes * C + c) * kLineWords);
    }
    typename T::Lanes a[R];
    for (int64_t r = 0; r < R; ++r) a[r] = T::load_lanes(x[r] + i);
    for (int64_t c = 0; c < C; ++c) {
      const auto b = T::load_lanes(e[c] + i);
      for (int64_t r = 0; r < R; ++r) T::madd(acc[r * C + c], a[r], b);
    }
  }
  const Vec sums = transpose_sum(acc);
  for (int64_t r = 0; r < R && row + r < p.m; ++r)
    for (int64_t c = 0; c < C && col + c < p.v; ++c) p.out[(row + r) * p.v + col + c] = sums[r * C + c];
}

template <typename T, int64_t R>
void run_head(ffi::ThreadPool& pool, const Head<T>& p) {
  constexpr int64_t C = kLanes / R;
  parallel_units(pool, (p.v + kHeadBlock - 1) / kHeadBlock, (p.m + 16) * p.k * p.v, [p](int64_t u) {
    const int64_t last = std::min((u + 1) * kHeadBlock, p.v);
    for (int64_t col = u * kHeadBlock; col < last; col += C)
      for (int64_t row = 0; row < p.m; row += R) head_tile<T, R, C>(p, row, col);
  });
}

template <typename T>
void run_head_rows(ffi::ThreadPool& pool, const Head<T>& p) {
  if (p.m == 0) return;
  if (p.m == 1 && std::is_same_v<T, Bf16>) {
    // bf16 rows are half as long, so a one-row tile's kLanes embedding rows are kLanes streams
    // of short runs; the 2-row tile (x's row twice) reads half as many at once, and ran a one-row
    // call in ~0.75x the time (the multiply-adds are not what limits it).
    run_head<T, 2>(pool, p);
  } else if (p.m == 1) {
    run_head<T, 1>(pool, p);
  } else if (p.m == 2) {
    run_head<T, 2>(pool, p);  // a tile of kHeadRows would compute every output twice
  } else {
    run_head<T, kHeadRows>(pool, p);
  }
}

// The rows of x the head computes: the first `live` (a step's logits rows that sample; the padding
// after them is zeroed, not computed). Returns -1 when `live` is out of [0, m].
int64_t live_rows(const ffi::Buffer<ffi::S32>& live, int64_t m, float* out, int64_t v) {
  const int64_t n = live.typed_data()[0];
  if (n < 0 || n > m) return -1;
  std::fill(out + n * v, out + m * v, 0.0f);
  return n;
}

ffi::Error HeadMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> e,
                          ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || ed[1] != xd[1] || xd[1] % kLanes != 0) {
    return ffi::Error::InvalidArgument("head matmul: x [M, K] and e [V, K] with K a multiple of the vector width");
  }
  const int64_t m = live_rows(live, xd[0], out->typed_data(), ed[0]);
  if (m < 0) return ffi::Error::InvalidArgument("head matmul: live rows out of range");
  const Head<F32> p{x.typed_data(), e.typed_data(), out->typed_data(), m, xd[1], ed[0]};
  if (p.v == 0) return ffi::Error::Success();
  run_head_rows(pool, p);
  return ffi::Error::Success();
}

// x f32 or bf16 [M, K], e bf16 [V, K], K a multiple of two vectors' lanes (kLanes pairs).
ffi::Error HeadMatmulBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::BF16> e,
                              ffi::Buffer<ffi::S32> live, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto ed = e.dimensions();
  if (!is_f32_or_bf16(x) || xd.size() != 2 || ed.size() != 2 || ed[1] != xd[1] || xd[1] % (2 * kLanes) != 0) {
    return ffi::Error::InvalidArgument(
        "bf16 head matmul: x f32 or bf16 [M, K] and bf16 e [V, K] with K a multiple of twice the vector width");
  }
  const int64_t m = live_rows(live, xd[0], out->typed_data(), ed[0]), pairs = xd[1] / 2;
  if (m < 0) return ffi::Error::InvalidArgument("bf16 head matmul: live rows out of range");
  if (m == 0 || ed[0] == 0) return ffi::Error::Success();
  const Head<Bf16> p{pair_rows(x, m, xd[1]), reinterpret_cast<const Pairs*>(e.untyped_data()), out->typed_data(),
                     m, pairs, ed[0]};
  run_head_rows(pool, p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w, panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLayerMatmulBf16, LayerMatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x, f32 or bf16
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, bf16 panels of pairs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveHeadMatmul, HeadMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e, the embedding
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live: rows computed, the rest zero
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveHeadMatmulBf16, HeadMatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x, f32 or bf16
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // e, the embedding
                                  .Arg<ffi::Buffer<ffi::S32>>()  // live: rows computed, the rest zero
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int64_t JaxserveMatmulPanel() { return kPanel; }

// 1 when the bf16 kernels multiply with AVX512-BF16's dot products, 0 when they widen to f32.
extern "C" int64_t JaxserveMatmulBf16Dot() { return JAXSERVE_DPBF16; }
