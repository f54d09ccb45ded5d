// Paged decode attention for XLA:CPU, called through the XLA FFI (kernels_pallas/cpu_attention.py
// builds and registers it).
//
// One query row per sequence: q [B, H, D] attends to the first lengths[b] tokens of its pages
// (block_tables [B, W]) in one layer of the stacked caches [L, KVH, P, BS, D], f32 throughout.
// Each (sequence, kv head) reads its keys and values once, straight from the cache pages (no
// gather copy), for its G = H / KVH query heads together: scores, softmax, then the weighted
// sum of values. Work items are split over `num_threads` threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* tables;
  const int32_t* lengths;
  float* out;
  int64_t batch, heads, dim, kv_heads, pages, block_size, width, layer;
  float scale, soft_cap;
  int32_t window;
};

using Vec = float __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxGroup = 16;  // query heads per kv head held in registers at once

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

using Half = float __attribute__((vector_size(32)));
using Quarter = float __attribute__((vector_size(16)));

inline float sum(Vec v) {  // a tree of halving adds, not 15 dependent scalar ones
  Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

template <typename F, size_t... I>
bool dispatch(int64_t chunks, F&& f, std::index_sequence<I...>) {
  return ((chunks == static_cast<int64_t>(I) + 1 && (f(std::integral_constant<int64_t, I + 1>{}), true)) || ...);
}

// Calls f(std::integral_constant<int64_t, C>{}) with C = dim / 16 for a dim that is a multiple
// of 16 up to 256 (the kernels are specialized on it); false for any other dim.
template <typename F>
bool with_head_dim(int64_t dim, F&& f) {
  return dim % kLanes == 0 && dispatch(dim / kLanes, f, std::make_index_sequence<16>{});
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

// Runs part(i) for i in [0, threads): part 0 on the calling thread, the others on new ones.
// One thread per `per_thread` units of `work`, at most `limit`: starting a thread costs tens
// of microseconds.
template <typename F>
void run_parts(int64_t work, int64_t per_thread, int64_t limit, F&& part) {
  const int64_t threads = std::max<int64_t>(1, std::min(work / per_thread, limit));
  std::vector<std::thread> helpers;
  for (int64_t i = 1; i < threads; ++i) helpers.emplace_back(part, i, threads);
  part(0, threads);
  for (auto& t : helpers) t.join();
}

// Attention of sequence b's query heads [g0, g0 + g_count) of kv head h, with head_dim =
// C * 16; `scores` has room for g_count * length.
template <int64_t C>
void attend(const Problem& p, int64_t b, int64_t h, int64_t g0, int64_t g_count, std::vector<float>& scores) {
  const int64_t group = p.heads / p.kv_heads;
  const float* q = p.q + (b * p.heads + h * group + g0) * p.dim;
  float* out = p.out + (b * p.heads + h * group + g0) * p.dim;
  const int64_t length = p.lengths[b];
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, length - p.window) : 0;
  const int64_t n = length - first;
  if (n <= 0) {
    std::fill(out, out + g_count * p.dim, 0.0f);
    return;
  }
  scores.resize(g_count * n);
  const int64_t head_base = (p.layer * p.kv_heads + h) * p.pages;
  const int64_t page_floats = p.block_size * p.dim;
  auto page_rows = [&](const float* cache, int64_t start) {
    return cache + (head_base + p.tables[b * p.width + start / p.block_size]) * page_floats;
  };
  // Calls f(t, row of token t in `cache`) for t in [first, length), a page at a time. Row i of
  // a page prefetches row i of the next page: pages are scattered, and the hardware
  // prefetcher stops at each one's end.
  auto for_each_row = [&](const float* cache, auto&& f) {
    for (int64_t start = first - first % p.block_size; start < length; start += p.block_size) {
      const float* rows = page_rows(cache, start);
      const float* next = start + p.block_size < length ? page_rows(cache, start + p.block_size) : rows;
      for (int64_t t = std::max(start, first), end = std::min(start + p.block_size, length); t < end; ++t) {
        for (int64_t c = 0; c < C; ++c) __builtin_prefetch(next + (t - start) * p.dim + c * kLanes);
        f(t, rows + (t - start) * p.dim);
      }
    }
  };
  Vec qv[kMaxGroup][C];
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t c = 0; c < C; ++c) qv[g][c] = load(q + g * p.dim + c * kLanes) * p.scale;
  float max_score[kMaxGroup];
  std::fill(max_score, max_score + g_count, -INFINITY);
  for_each_row(p.k, [&](int64_t t, const float* key) {
    Vec k[C];
    for (int64_t c = 0; c < C; ++c) k[c] = load(key + c * kLanes);
    for (int64_t g = 0; g < g_count; ++g) {
      Vec acc = qv[g][0] * k[0];
      for (int64_t c = 1; c < C; ++c) acc += qv[g][c] * k[c];
      float s = sum(acc);
      if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
      scores[g * n + (t - first)] = s;
      max_score[g] = std::max(max_score[g], s);
    }
  });
  float inv_total[kMaxGroup];
  for (int64_t g = 0; g < g_count; ++g) {
    float* sg = scores.data() + g * n;
    float total = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - max_score[g]);
      total += sg[i];
    }
    inv_total[g] = 1.0f / total;
  }
  Vec acc[kMaxGroup][C] = {};
  for_each_row(p.v, [&](int64_t t, const float* value) {
    Vec v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = load(value + c * kLanes);
    for (int64_t g = 0; g < g_count; ++g) {
      const float w = scores[g * n + (t - first)];
      for (int64_t c = 0; c < C; ++c) acc[g][c] += w * v[c];
    }
  });
  for (int64_t g = 0; g < g_count; ++g)
    for (int64_t c = 0; c < C; ++c) store(out + g * p.dim + c * kLanes, acc[g][c] * inv_total[g]);
}

// One (sequence, kv head) item, its query heads in register-sized groups.
template <int64_t C>
void attend_item(const Problem& p, int64_t b, int64_t h, std::vector<float>& scores) {
  const int64_t group = p.heads / p.kv_heads;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) attend<C>(p, b, h, g0, std::min(kMaxGroup, group - g0), scores);
}

ffi::Error PagedDecodeImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> lengths, float scale, float soft_cap, int32_t window,
                           int32_t num_threads, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto cd = k_cache.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2 || td[0] != qd[0] || cd[4] != qd[2] ||
      qd[1] % cd[1] != 0 || lengths.element_count() != static_cast<size_t>(qd[0]) ||
      !std::equal(cd.begin(), cd.end(), v_cache.dimensions().begin(), v_cache.dimensions().end())) {
    return ffi::Error::InvalidArgument("paged decode: inconsistent shapes");
  }
  Problem p{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), block_tables.typed_data(),
            lengths.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], cd[1], cd[2], cd[3], td[1],
            static_cast<int64_t>(layer.typed_data()[0]), scale, soft_cap, window};
  if (p.layer < 0 || p.layer >= cd[0]) return ffi::Error::InvalidArgument("paged decode: layer out of range");
  int64_t rows = 0;  // K/V rows the call reads, per kv head
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t length = p.lengths[b];
    rows += p.window > 0 ? std::min<int64_t>(length, p.window) : length;
    if (length < 0 || length > p.width * p.block_size) {
      return ffi::Error::InvalidArgument("paged decode: length beyond the block table");
    }
    if (!pages_in_range(p.tables, p.width, p.block_size, p.pages, b, length)) {
      return ffi::Error::InvalidArgument("paged decode: page out of range");
    }
  }
  const int64_t items = p.batch * p.kv_heads;
  const bool served = with_head_dim(p.dim, [&](auto chunks) {
    run_parts(rows * p.kv_heads, 8192, std::min<int64_t>(num_threads, items), [&](int64_t part, int64_t parts) {
      std::vector<float> scores;
      for (int64_t i = part; i < items; i += parts) attend_item<decltype(chunks)::value>(p, i / p.kv_heads, i % p.kv_heads, scores);
    });
  });
  if (!served) return ffi::Error::InvalidArgument("paged decode: head_dim must be a multiple of 16, at most 256");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Attr<int32_t>("num_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ---- Ragged prefill attention ------------------------------------------------------------
//
// q [T, H, D]: rows query_start[s]..query_start[s + 1] are sequence s's newest rows, causal
// over its seq_lens[s] tokens. An item is 16 rows (a tile, one lane per row) of one sequence
// and one kv head; each of its query heads walks the keys 16 at a time with an online
// softmax, scores and outputs held transposed (a vector per key, per head dimension) so every
// product is a vector FMA with a broadcast operand.

namespace {

using IVec = int32_t __attribute__((vector_size(64)));

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

inline Vec max(Vec a, Vec b) { return a > b ? a : b; }

struct Ragged {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  float* out;
  int64_t heads, dim, kv_heads, pages, block_size, width, layer;
  float scale, soft_cap;
  int32_t window;
};

struct Tile {
  int64_t seq, first_row, num_rows;
};

constexpr float kMasked = -1e30f;  // finite: a fully masked key block must not give inf - inf

template <int64_t C>
void prefill_tile(const Ragged& p, const Tile& tile, int64_t h) {
  constexpr int64_t D = C * kLanes;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t s = tile.seq, q_len = p.query_start[s + 1] - p.query_start[s];
  const int64_t first_pos = p.seq_lens[s] - q_len + tile.first_row;  // position of lane 0
  const int64_t last_pos = first_pos + tile.num_rows - 1;
  IVec lane;
  for (int64_t i = 0; i < kLanes; ++i) lane[i] = static_cast<int32_t>(i);
  const IVec pos = lane + static_cast<int32_t>(first_pos);
  const IVec real = lane < static_cast<int32_t>(tile.num_rows);
  const int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const int64_t head_base = (p.layer * p.kv_heads + h) * p.pages;
  const int64_t row0 = p.query_start[s] + tile.first_row;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    Vec qt[D];  // qt[d][i] = q[row i, head, d] * scale
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t i = 0; i < kLanes; ++i) {
        qt[d][i] = i < tile.num_rows ? p.q[((row0 + i) * p.heads + head) * D + d] * p.scale : 0.0f;
      }
    }
    Vec m = Vec{} + kMasked, l = Vec{}, ot[D] = {};
    for (int64_t kb = key_lo; kb <= last_pos; kb += kLanes) {
      const int64_t nb = std::min<int64_t>(kLanes, last_pos + 1 - kb);
      const float* krow[kLanes];
      const float* vrow[kLanes];
      for (int64_t j = 0, kpos = kb; j < nb; ++j, ++kpos) {
        const int64_t page = p.tables[s * p.width + kpos / p.block_size];
        const int64_t offset = ((head_base + page) * p.block_size + kpos % p.block_size) * D;
        krow[j] = p.k + offset;
        vrow[j] = p.v + offset;
      }
      Vec sc[kLanes];
      Vec block_max = Vec{} + kMasked;
      for (int64_t j = 0; j < nb; ++j) {
        Vec acc = Vec{};
        for (int64_t d = 0; d < D; ++d) acc += qt[d] * krow[j][d];
        if (p.soft_cap > 0.0f) acc = p.soft_cap * tanh(acc / p.soft_cap);
        const int32_t kpos = static_cast<int32_t>(kb + j);
        IVec valid = (kpos <= pos) & real;
        if (p.window > 0) valid &= kpos > pos - p.window;
        sc[j] = valid ? acc : Vec{} + kMasked;
        block_max = max(block_max, sc[j]);
      }
      const Vec m_new = max(m, block_max);
      const Vec alpha = exp(m - m_new);
      l *= alpha;
      for (int64_t d = 0; d < D; ++d) ot[d] *= alpha;
      for (int64_t j = 0; j < nb; ++j) {
        const Vec e = exp(sc[j] - m_new);
        const Vec pj = sc[j] > kMasked ? e : Vec{};
        l += pj;
        for (int64_t d = 0; d < D; ++d) ot[d] += pj * vrow[j][d];
      }
      m = m_new;
    }
    for (int64_t i = 0; i < tile.num_rows; ++i) {
      float* out = p.out + ((row0 + i) * p.heads + head) * D;
      const float inv = 1.0f / l[i];
      for (int64_t d = 0; d < D; ++d) out[d] = ot[d][i] * inv;
    }
  }
}

ffi::Error PagedPrefillImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                            ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start, float scale,
                            float soft_cap, int32_t window, int32_t num_threads, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto cd = k_cache.dimensions();
  const auto td = block_tables.dimensions();
  const int64_t num_seqs = td.size() == 2 ? td[0] : -1;
  if (qd.size() != 3 || cd.size() != 5 || td.size() != 2 || cd[4] != qd[2] || qd[1] % cd[1] != 0 ||
      seq_lens.element_count() != static_cast<size_t>(num_seqs) ||
      query_start.element_count() != static_cast<size_t>(num_seqs + 1) ||
      !std::equal(cd.begin(), cd.end(), v_cache.dimensions().begin(), v_cache.dimensions().end())) {
    return ffi::Error::InvalidArgument("paged prefill: inconsistent shapes");
  }
  Ragged p{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), block_tables.typed_data(),
           seq_lens.typed_data(), query_start.typed_data(), out->typed_data(), qd[1], qd[2], cd[1], cd[2], cd[3],
           td[1], static_cast<int64_t>(layer.typed_data()[0]), scale, soft_cap, window};
  if (p.layer < 0 || p.layer >= cd[0]) return ffi::Error::InvalidArgument("paged prefill: layer out of range");
  std::vector<Tile> tiles;
  int64_t work = 0;  // query rows x keys, per kv head
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t lo = p.query_start[s], hi = p.query_start[s + 1], length = p.seq_lens[s];
    if (lo < 0 || hi < lo || hi > qd[0] || length < hi - lo || length > p.width * p.block_size) {
      return ffi::Error::InvalidArgument("paged prefill: query_start / seq_lens out of range");
    }
    if (!pages_in_range(p.tables, p.width, p.block_size, p.pages, s, length)) {
      return ffi::Error::InvalidArgument("paged prefill: page out of range");
    }
    for (int64_t r = 0; r < hi - lo; r += kLanes) tiles.push_back({s, r, std::min<int64_t>(kLanes, hi - lo - r)});
    work += (hi - lo) * length;
  }
  // Rows no sequence owns (the step's padding) are zeros.
  const int64_t covered = num_seqs > 0 ? p.query_start[num_seqs] : 0;
  std::fill(p.out + covered * p.heads * p.dim, p.out + qd[0] * p.heads * p.dim, 0.0f);
  const int64_t items = static_cast<int64_t>(tiles.size()) * p.kv_heads;
  const bool served = with_head_dim(p.dim, [&](auto chunks) {
    run_parts(work * p.kv_heads, 1 << 16, std::min<int64_t>(num_threads, items), [&](int64_t part, int64_t parts) {
      for (int64_t i = part; i < items; i += parts) prefill_tile<decltype(chunks)::value>(p, tiles[i / p.kv_heads], i % p.kv_heads);
    });
  });
  if (!served) return ffi::Error::InvalidArgument("paged prefill: head_dim must be a multiple of 16, at most 256");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedPrefill, PagedPrefillImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Attr<int32_t>("num_threads")
                                  .Ret<ffi::Buffer<ffi::F32>>());
