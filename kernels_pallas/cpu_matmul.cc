// Matmuls for XLA:CPU through the XLA FFI (kernels_pallas/cpu_matmul.py builds and registers
// them, and lays the weights out): activations with one layer of stacked weights stored in
// panels, and with the embedding as the tied output head (at the end of the file).
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

#include <algorithm>
#include <cstdint>
#include <utility>

#include "cpu_parallel.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 6;  // rows of a tile: 6 x 4 accumulators of 32 registers
constexpr int64_t kHeadRows = 4;  // output head: rows x embedding rows = kLanes accumulators
#else
constexpr int64_t kMaxRows = 3;  // 3 x 4 of 16
constexpr int64_t kHeadRows = 2;
#endif
constexpr int64_t kVecs = 4;  // vectors per panel row
constexpr int64_t kPanel = kVecs * kLanes;
constexpr int64_t kRowBlock = 4 * kMaxRows;  // rows of a unit of work (see `run` for calls of few rows)
constexpr int64_t kFewRows = 64;  // a call of at most this many rows may take them all in one unit
constexpr int64_t kPrefetch = 2048;  // floats ahead of the stream a tile reads
constexpr int64_t kLineVecs = std::max<int64_t>(1, 64 / (kLanes * sizeof(float)));  // vectors per cache line
constexpr int64_t kLineFloats = 64 / sizeof(float);

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // the layer's panels [N / P, K, P]
  float* out;      // [M, N]
  int64_t m, k, n;
};

// out[R rows from `row`, panels [panel, panel + G)] = x[rows] @ those panels. Meanwhile it
// prefetches `ahead_lines` cache lines from `ahead` (weights the thread reads next).
template <int64_t R, int64_t G>
void tile(const Problem& p, int64_t row, int64_t panel, const float* ahead = nullptr, int64_t ahead_lines = 0) {
  Vec acc[R][G][kVecs] = {};
  const float* x = p.x + row * p.k;
  const float* w = p.w + panel * p.k * kPanel;
  const int64_t per_step = (ahead_lines + p.k - 1) / p.k;
  for (int64_t i = 0; i < p.k; ++i, w += kPanel) {
    for (int64_t j = i * per_step; j < std::min(ahead_lines, (i + 1) * per_step); ++j) {
      __builtin_prefetch(ahead + j * kLineFloats);
    }
    Vec b[G][kVecs];
    for (int64_t g = 0; g < G; ++g) {
      const float* wg = w + g * p.k * kPanel;
      for (int64_t v = 0; v < kVecs; v += kLineVecs) __builtin_prefetch(wg + kPrefetch + v * kLanes);
      for (int64_t v = 0; v < kVecs; ++v) b[g][v] = load(wg + v * kLanes);
    }
    for (int64_t r = 0; r < R; ++r) {
      const Vec a = Vec{} + x[r * p.k + i];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t v = 0; v < kVecs; ++v) acc[r][g][v] += a * b[g][v];
    }
  }
  float* out = p.out + row * p.n + panel * kPanel;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t v = 0; v < kVecs; ++v) store(out + r * p.n + g * kPanel + v * kLanes, acc[r][g][v]);
}

template <int64_t G, int64_t... R>
void short_tile(const Problem& p, int64_t rows, int64_t row, int64_t panel, std::integer_sequence<int64_t, R...>) {
  ((rows == R + 1 && (tile<R + 1, G>(p, row, panel), true)) || ...);
}

// Rows [first, last) of panels [panel, panel + G): tiles of R rows, then the rows left over.
// The first tile streams the panels from memory, the others read them from L2; those others
// prefetch, evenly between them, the panels from `next` (-1: none), so that the memory streams
// them while the multiply-adds run.
template <int64_t R, int64_t G>
void rows(const Problem& p, int64_t first, int64_t last, int64_t panel, int64_t next = -1) {
  const int64_t later_tiles = std::max<int64_t>(0, (last - first) / R - 1);  // full tiles after the first
  const int64_t lines = next < 0 || later_tiles == 0 ? 0 : G * p.k * kPanel / kLineFloats;
  const int64_t per_tile = later_tiles == 0 ? 0 : (lines + later_tiles - 1) / later_tiles;
  const float* ahead = p.w + std::max<int64_t>(next, 0) * p.k * kPanel;
  int64_t row = first, prefetched = 0;
  for (; row + R <= last; row += R) {
    const int64_t n = row == first ? 0 : std::min(per_tile, lines - prefetched);
    tile<R, G>(p, row, panel, ahead + prefetched * kLineFloats, n);
    prefetched += n;
  }
  if (row < last) short_tile<G>(p, last - row, row, panel, std::make_integer_sequence<int64_t, R - 1>{});
}

// Rows [first, last) of the G panels from `panel`, or of that panel alone when it is the odd
// one of a two-panel call; `next`: the panel group to prefetch meanwhile (see `rows`).
template <int64_t R, int64_t G>
void group(const Problem& p, int64_t first, int64_t last, int64_t panel, int64_t next = -1) {
  if (panel + G <= p.n / kPanel) {
    rows<R, G>(p, first, last, panel, next);
  } else {
    rows<R, 1>(p, first, last, panel);
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
template <int64_t R, int64_t G>
void run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t panels = p.n / kPanel, groups = (panels + G - 1) / G, workers = pool.num_threads() + 1;
  const int64_t cost = (p.m + 16) * p.k * p.n;
  if (p.m <= kFewRows && groups >= 2 * workers) {
    // Units of `chunk` consecutive panel groups (two units per worker or more).
    const int64_t chunk = groups / (2 * workers);
    parallel_units(pool, (groups + chunk - 1) / chunk, cost, [p, panels, groups, chunk](int64_t u) {
      const int64_t end = std::min(groups, (u + 1) * chunk);
      for (int64_t g = u * chunk; g < end; ++g) {
        group<R, G>(p, 0, p.m, g * G, g + 1 < end && (g + 2) * G <= panels ? (g + 1) * G : -1);
      }
    });
    return;
  }
  const int64_t blocks = (p.m + kRowBlock - 1) / kRowBlock;
  parallel_units(pool, groups * blocks, cost, [p, blocks](int64_t u) {
    const int64_t first = u % blocks * kRowBlock;
    group<R, G>(p, first, std::min(first + kRowBlock, p.m), u / blocks * G);
  });
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
  const Problem p{x.typed_data(), w.typed_data() + l * layer_size, out->typed_data(), xd[0], xd[1], wd[1] * kPanel};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.m == 1) {
    run<1, 2>(pool, p);
  } else {
    run<kMaxRows, 1>(pool, p);
  }
  return ffi::Error::Success();
}

// The output head tied to the embedding: out [M, V] = x [M, K] @ e [V, K]^T, K a multiple of
// kLanes. Each output is a dot product of two rows, so a tile of R rows of x by C rows of e
// (R * C = kLanes) accumulates a vector per pair over K and ends with one transpose_sum. Tiles
// at the edges repeat the last row of x or e and store only their own outputs.
struct Head {
  const float* x;
  const float* e;
  float* out;
  int64_t m, k, v;
};

constexpr int64_t kHeadBlock = 64;  // embedding rows of a unit of work

template <int64_t R, int64_t C>
void head_tile(const Head& p, int64_t row, int64_t col) {
  static_assert(R * C == kLanes);
  const float* x[R];
  const float* e[C];
  for (int64_t r = 0; r < R; ++r) x[r] = p.x + std::min(row + r, p.m - 1) * p.k;
  for (int64_t c = 0; c < C; ++c) e[c] = p.e + std::min(col + c, p.v - 1) * p.k;
  Vec acc[kLanes] = {};
  for (int64_t i = 0; i < p.k; i += kLanes) {
    Vec a[R];
    for (int64_t r = 0; r < R; ++r) a[r] = load(x[r] + i);
    for (int64_t c = 0; c < C; ++c) {
      const Vec b = load(e[c] + i);
      for (int64_t r = 0; r < R; ++r) acc[r * C + c] += a[r] * b;
    }
  }
  const Vec sums = transpose_sum(acc);
  for (int64_t r = 0; r < R && row + r < p.m; ++r)
    for (int64_t c = 0; c < C && col + c < p.v; ++c) p.out[(row + r) * p.v + col + c] = sums[r * C + c];
}

template <int64_t R>
void run_head(ffi::ThreadPool& pool, const Head& p) {
  constexpr int64_t C = kLanes / R;
  parallel_units(pool, (p.v + kHeadBlock - 1) / kHeadBlock, (p.m + 16) * p.k * p.v, [p](int64_t u) {
    const int64_t last = std::min((u + 1) * kHeadBlock, p.v);
    for (int64_t col = u * kHeadBlock; col < last; col += C)
      for (int64_t row = 0; row < p.m; row += R) head_tile<R, C>(p, row, col);
  });
}

ffi::Error HeadMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> e,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || ed[1] != xd[1] || xd[1] % kLanes != 0) {
    return ffi::Error::InvalidArgument("head matmul: x [M, K] and e [V, K] with K a multiple of the vector width");
  }
  const Head p{x.typed_data(), e.typed_data(), out->typed_data(), xd[0], xd[1], ed[0]};
  if (p.m == 0 || p.v == 0) return ffi::Error::Success();
  if (p.m == 1) {
    run_head<1>(pool, p);
  } else if (p.m == 2) {
    run_head<2>(pool, p);  // a tile of kHeadRows would compute every output twice
  } else {
    run_head<kHeadRows>(pool, p);
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveHeadMatmul, HeadMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e, the embedding
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int64_t JaxserveMatmulPanel() { return kPanel; }
