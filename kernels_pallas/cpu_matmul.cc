// Matmul of activations with one layer of stacked weights, for XLA:CPU, through the XLA FFI
// (kernels_pallas/cpu_matmul.py builds and registers it).
//
// out [M, N] = x [M, K] @ w[layer] for stacked f32 weights w [L, K, N], read in place: in a
// scanned layer loop XLA:CPU copies a layer's slice of its stacked weights before an XLA dot,
// and its dot of a few rows runs far below memory speed. Register tiles of R rows x V vectors
// of output accumulate over passes of 64 rows of K, each weight row loaded once per tile and
// every product a vector FMA; the column blocks of a call are split over XLA's intra-op threads.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // floats per vector register
constexpr int64_t kTile = 24;   // accumulators of a register tile (of 32 registers)
constexpr int64_t kMaxRows = 8;  // rows of a tile at most (then kTile / kMaxRows vectors wide)
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kTile = 12;   // of AVX2's 16 registers
constexpr int64_t kMaxRows = 6;
#endif

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

constexpr int64_t kChunk = 64;  // rows of the weights a pass over a thread's column blocks reads

struct Problem {
  const float* x;
  const float* w;  // layer's [K, N]
  float* out;
  int64_t m, k, n;
  int64_t k0 = 0, k1 = 0;  // the rows of w of this pass
};

// out[R rows from `row`, V vectors from `col`] += x[.., k0:k1] @ w[k0:k1, ..] (= at k0 == 0).
template <int64_t R, int64_t V>
void tile(const Problem& p, int64_t row, int64_t col) {
  Vec acc[R][V] = {};
  float* out = p.out + row * p.n + col;
  if (p.k0 > 0)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < V; ++v) acc[r][v] = load(out + r * p.n + v * kLanes);
  const float* x = p.x + row * p.k;
  const float* w = p.w + p.k0 * p.n + col;
  for (int64_t i = p.k0; i < p.k1; ++i, w += p.n) {
    __builtin_prefetch(w + kChunk * p.n);  // this column's piece of the next pass
    Vec b[V];
    for (int64_t v = 0; v < V; ++v) b[v] = load(w + v * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const Vec a = Vec{} + x[r * p.k + i];
      for (int64_t v = 0; v < V; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) store(out + r * p.n + v * kLanes, acc[r][v]);
}

template <int64_t V, int64_t... R>
void rows_tile(const Problem& p, int64_t rows, int64_t row, int64_t col, std::integer_sequence<int64_t, R...>) {
  ((rows == R + 1 && (tile<R + 1, V>(p, row, col), true)) || ...);
}

// Every row of the V-vector column block at `col`: tiles of R rows, then the rows left over.
template <int64_t R, int64_t V>
void column_block(const Problem& p, int64_t col) {
  int64_t row = 0;
  for (; row + R <= p.m; row += R) tile<R, V>(p, row, col);
  if (row < p.m) rows_tile<V>(p, p.m - row, row, col, std::make_integer_sequence<int64_t, R - 1>{});
}

template <int64_t R, int64_t... V>
void last_block(const Problem& p, int64_t vecs, int64_t col, std::integer_sequence<int64_t, V...>) {
  ((vecs == V + 1 && (column_block<R, V + 1>(p, col), true)) || ...);
}

// Column blocks [first, last) of V vectors (the last one may be narrower), in tiles of R x V,
// in passes of kChunk weight rows: a pass reads kChunk rows of the blocks' columns, each a
// contiguous run, where one tile over all of K would read short pieces of K rows N floats
// apart, a pattern the memory system serves at half its speed. Few rows make wide tiles, and
// so longer pieces.
template <int64_t R, int64_t V>
void column_blocks(const Problem& whole, int64_t first, int64_t last) {
  constexpr int64_t block = V * kLanes;
  for (int64_t k0 = 0; k0 < whole.k; k0 += kChunk) {
    Problem p = whole;
    p.k0 = k0;
    p.k1 = std::min(k0 + kChunk, whole.k);
    for (int64_t b = first; b < last; ++b) {
      const int64_t col = b * block, vecs = std::min(block, p.n - col) / kLanes;
      if (vecs == V) {
        column_block<R, V>(p, col);
      } else {
        last_block<R>(p, vecs, col, std::make_integer_sequence<int64_t, V - 1>{});
      }
    }
  }
}

// Splits the column blocks into `parts` ranges that XLA's pool threads and the caller claim
// from a shared counter: the caller runs whatever no pool thread has started, so the call
// never waits on a task still queued (and a task that starts late finds nothing to do).
template <int64_t R, int64_t V>
void run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t blocks = (p.n + V * kLanes - 1) / (V * kLanes);
  // A part of at least ~1M multiply-adds: below that a pool thread's wake-up costs more.
  const int64_t work = p.m * p.k * p.n;
  const int64_t parts = std::max<int64_t>(1, std::min({blocks, pool.num_threads() + 1, work >> 20}));
  struct Shared {
    Problem p;
    int64_t blocks, parts;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->blocks = blocks;
  shared->parts = parts;
  auto claim = [](Shared& s) {
    for (int64_t i; (i = s.next.fetch_add(1)) < s.parts;) {
      column_blocks<R, V>(s.p, i * s.blocks / s.parts, (i + 1) * s.blocks / s.parts);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < parts; ++i) pool.Schedule([shared, claim] { claim(*shared); });
  claim(*shared);
  while (shared->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

// The tile of a call of m rows: min(m, kMaxRows) rows (or fewer, when that spreads them
// evenly) and as many vectors as the accumulators allow.
template <int64_t... R>
void run_rows(ffi::ThreadPool& pool, const Problem& p, std::integer_sequence<int64_t, R...>) {
  const int64_t tiles = (p.m + kMaxRows - 1) / kMaxRows, rows = (p.m + tiles - 1) / tiles;
  ((rows == R + 1 && (run<R + 1, kTile / (R + 1)>(pool, p), true)) || ...);
}

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] % kLanes != 0) {
    return ffi::Error::InvalidArgument("layer matmul: x [M, K] and w [L, K, N] with N a multiple of the vector width");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("layer matmul: layer out of range");
  run_rows(pool, Problem{x.typed_data(), w.typed_data() + l * wd[1] * wd[2], out->typed_data(), xd[0], xd[1], wd[2]},
           std::make_integer_sequence<int64_t, kMaxRows>{});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLayerMatmul, LayerMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int64_t JaxserveMatmulLanes() { return kLanes; }
