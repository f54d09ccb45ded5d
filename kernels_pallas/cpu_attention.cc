// Paged attention for XLA:CPU, called through the XLA FFI (kernels_pallas/cpu_attention.py
// builds and registers it), on the stacked caches [L, KVH, P, BS, R] of any storage format of
// kernels_pallas/kv_quant.py (a row R = D values, then a scale for int8 / fp8: cpu_kv_rows.h),
// with f32 queries, products, softmax and output.
//
// Decode: one query row per sequence: q [B, H, D] attends to the first lengths[b] tokens of its
// pages (block_tables [B, W]). Each (sequence, kv head) reads its keys and values once, straight
// from the cache pages (no gather copy), for its G = H / KVH query heads: scores a vector of
// keys at a time, softmax, then the weighted sum of values. Work items are split over XLA's
// intra-op threads (cpu_parallel.h).
//
// Vectors are the machine's registers (cpu_vector.h).
//
// Attention sinks (gpt-oss): sinks [H] holds a logit per query head that joins each softmax's
// denominator and has no value; a head without one has kMasked there (e^(kMasked - m) is 0, so
// the results are those of plain attention).
//
// Prefill of bf16 queries (bf16 activations) takes its products in bf16 pairs (cpu_bf16.h; one
// AVX512-BF16 dot product per two multiply-adds where the CPU has it): Q^T and each key block as
// pairs along the head dimension, the softmax weights P^T and each value block as pairs along the
// keys. The queries and a bf16 cache's rows are bf16 already, so the only new rounding is P's
// (to bf16, as GPU flash attention does); sums, the softmax and its normalizer stay f32. Decode of
// bf16 queries on a bf16 cache does the same (`attend_pairs`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_bf16.h"
#include "cpu_kv_rows.h"
#include "cpu_parallel.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace {

constexpr int64_t kMaxGroup = 4;  // query heads per kv head a decode pass holds in registers
constexpr int64_t kPrefetchKeys = 16;  // how far ahead the key pass prefetches

struct Problem {
  const float* q;
  const void* k;  // of the kernel's element type
  const void* v;
  const int32_t* tables;
  const int32_t* lengths;
  const float* sinks;  // [H]
  float* out;
  int64_t batch, heads, dim, kv_heads, pages, block_size, width, layer;
  float scale, soft_cap;
  int32_t window;
};

// Per-thread scratch of the decode kernel.
struct DecodeScratch {
  std::vector<float> scores;
  std::vector<Pairs> weights;  // bf16 products: the softmax weights as pairs of consecutive keys
  std::vector<int64_t> rows;   // token offsets
};

// A block of kLanes keys' scores of one query head, finished: soft-capped, keys past the end
// (`real` false) masked, the head's running maximum updated, stored at `out`.
inline void finish_scores(const Problem& p, Vec s, IVec real, Vec& best, float* out) {
  if (p.soft_cap > 0.0f) s = p.soft_cap * tanh(s / p.soft_cap);
  s = real ? s : Vec{} + kMasked;
  best = max(best, s);
  store(out, s);
}

// One query head's scores [stride] -> their softmax numerators e^(s - max), in place (masked
// keys 0); returns 1 / (their sum + the head's sink's e^(sink - max)), the max counting the sink.
inline float exp_scores(float* scores, int64_t stride, Vec best, float sink) {
  const float m = std::max(max_lane(best), sink);
  Vec total = Vec{};
  for (int64_t i = 0; i < stride; i += kLanes) {
    const Vec s = load(scores + i);
    const Vec e = s > kMasked ? exp(s - m) : Vec{};
    total += e;
    store(scores + i, e);
  }
  return 1.0f / (sum_lanes(total) + std::exp(sink - m));
}

// A decode pass's share of its (sequence b, kv head h) item: query heads [g0, g0 + G) of head_dim
// D, their outputs, the n keys [first, length) they attend to, and those keys' offsets in the item's
// (layer, kv head) slice of the cache, rows of R elements; the scores sized to G x `stride`. With
// no keys (n == 0) the outputs are written as zeros here.
struct DecodePass {
  const float* q;
  float* out;
  int64_t n, stride, slice;
  const int64_t* rows;
};

template <int64_t D, int64_t R, int64_t G>
DecodePass decode_pass(const Problem& p, int64_t b, int64_t h, int64_t g0, DecodeScratch& scratch) {
  const int64_t group = p.heads / p.kv_heads;
  const float* q = p.q + (b * p.heads + h * group + g0) * D;
  float* out = p.out + (b * p.heads + h * group + g0) * D;
  const int64_t length = p.lengths[b];
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, length - p.window) : 0;
  const int64_t n = std::max<int64_t>(0, length - first), stride = (n + kLanes - 1) / kLanes * kLanes;
  if (n == 0) {
    std::fill(out, out + G * D, 0.0f);
    return {q, out, 0, 0, 0, nullptr};
  }
  scratch.scores.resize(G * stride);
  token_offsets(p.tables + b * p.width, p.block_size, R, first, length, scratch.rows);
  return {q, out, n, stride, (p.layer * p.kv_heads + h) * p.pages * p.block_size * R, scratch.rows.data()};
}

// Decode: sequence b's query heads [g0, g0 + G) of kv head h over keys [first, length) (n of
// them), head_dim D = C * 16, cache elements of type T.
template <typename T, int64_t C, int64_t G>
void attend(const Problem& p, int64_t b, int64_t h, int64_t g0, DecodeScratch& scratch) {
  constexpr int64_t D = C * kDimStep, DV = D / kLanes;  // vectors per row
  constexpr int64_t R = D + kRowExtra<T>;  // elements per cache row
  const auto [q, out, n, stride, slice, rows] = decode_pass<D, R, G>(p, b, h, g0, scratch);
  if (n == 0) return;
  std::vector<float>& scores = scratch.scores;
  const T* keys = static_cast<const T*>(p.k) + slice;
  const T* values = static_cast<const T*>(p.v) + slice;
  Vec qv[G][DV];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < DV; ++c) qv[g][c] = load(q + g * D + c * kLanes) * p.scale;
  // Scores, kLanes keys at a time: a dot product per (head, key) in lanes of the head
  // dimension, then one transpose_sum gives the block's scores as a vector.
  Vec best[G];
  for (int64_t g = 0; g < G; ++g) best[g] = Vec{} + kMasked;
  for (int64_t kb = 0; kb < n; kb += kLanes) {
    const T* row[kLanes];
    Vec key_scale = Vec{} + 1.0f;
    for (int64_t j = 0; j < kLanes; ++j) {
      row[j] = keys + rows[std::min(kb + j, n - 1)];
      if constexpr (kScaled<T>) key_scale[j] = kv_scale(row[j], D);
    }
    // Rows kPrefetchKeys ahead, keys and values: the value pass then finds its rows in L2.
    for (int64_t j = kb + kPrefetchKeys; j < std::min(kb + kPrefetchKeys + kLanes, n); ++j)
      for (int64_t line = 0; line < R * static_cast<int64_t>(sizeof(T)); line += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(keys + rows[j]) + line);
        __builtin_prefetch(reinterpret_cast<const char*>(values + rows[j]) + line);
      }
    const IVec lane_key = [] { IVec l; for (int64_t i = 0; i < kLanes; ++i) l[i] = static_cast<int32_t>(i); return l; }();
    const IVec real = lane_key < static_cast<int32_t>(n - kb);
    for (int64_t g = 0; g < G; ++g) {
      Vec acc[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) {
        Vec a = qv[g][0] * load_kv(row[j]);
        for (int64_t c = 1; c < DV; ++c) a += qv[g][c] * load_kv(row[j] + c * kLanes);
        acc[j] = a;
      }
      Vec s = transpose_sum(acc);
      if constexpr (kScaled<T>) s *= key_scale;
      finish_scores(p, s, real, best[g], scores.data() + g * stride + kb);
    }
  }
  float inv_total[G];
  const float* sinks = p.sinks + h * (p.heads / p.kv_heads) + g0;
  for (int64_t g = 0; g < G; ++g) inv_total[g] = exp_scores(scores.data() + g * stride, stride, best[g], sinks[g]);
  // Weighted values, kValueBlock keys at a time: the block's rows are read from memory by its
  // first pass over two vectors of the head dimension (G x 2 accumulators), from L1 by the next.
  constexpr int64_t kValueBlock = 32;
  Vec acc[G][DV] = {};
  for (int64_t tb = 0; tb < n; tb += kValueBlock) {
    const int64_t te = std::min(tb + kValueBlock, n);
    for (int64_t c = 0; c < DV; c += 2) {
      const bool pair = c + 1 < DV;
      Vec a[G][2];
      for (int64_t g = 0; g < G; ++g) a[g][0] = acc[g][c], a[g][1] = pair ? acc[g][c + 1] : Vec{};
      for (int64_t t = tb; t < te; ++t) {
        const T* value = values + rows[t] + c * kLanes;
        const float value_scale = kv_scale(values + rows[t], D);
        const Vec v0 = load_kv(value), v1 = pair ? load_kv(value + kLanes) : Vec{};
        for (int64_t g = 0; g < G; ++g) {
          const float e = scores[g * stride + t] * value_scale;
          a[g][0] += e * v0;
          a[g][1] += e * v1;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        acc[g][c] = a[g][0];
        if (pair) acc[g][c + 1] = a[g][1];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < DV; ++c) store(out + g * D + c * kLanes, acc[g][c] * inv_total[g]);
}

#if JAXSERVE_DPBF16
// `attend` for bf16 queries on a bf16 cache, products in bf16 pairs (AVX512-BF16's dot products,
// as prefill's): a score is the dot product of the query's pairs with the key row's, which is
// pairs along the head dimension as stored; the weighted values take the softmax weights
// rounded to pairs of consecutive keys and the two keys' value rows interleaved into pairs by an
// unpack. An unpack interleaves within 128-bit lanes, so the accumulators hold the dimensions in
// its order, put back by one permute per output vector. D a multiple of 32 (two unpacks per
// 32 dimensions); the vector instructions per key are a third of `attend`'s, which widens every
// bf16 element to f32 once per query head.
template <int64_t C, int64_t G>
void attend_pairs(const Problem& p, int64_t b, int64_t h, int64_t g0, DecodeScratch& scratch) {
  constexpr int64_t D = C * kDimStep, PV = D / 2 / kLanes;  // vectors of pairs per row
  static_assert(D % 32 == 0 && kLanes == 16);
  constexpr int64_t R = D;  // elements per cache row
  const auto [q, out, n, stride, slice, rows] = decode_pass<D, R, G>(p, b, h, g0, scratch);
  if (n == 0) return;
  std::vector<float>& scores = scratch.scores;
  scratch.weights.resize(G * stride / 2);
  const uint16_t* keys = static_cast<const uint16_t*>(p.k) + slice;
  const uint16_t* values = static_cast<const uint16_t*>(p.v) + slice;
  IVec qp[G][PV];
  for (int64_t g = 0; g < G; ++g) {
    float scaled[D];
    Pairs pairs[D / 2];
    for (int64_t d = 0; d < D; ++d) scaled[d] = q[g * D + d] * p.scale;
    pairs_in_order(scaled, D / 2, pairs);
    for (int64_t c = 0; c < PV; ++c) qp[g][c] = load_pairs(pairs + c * kLanes);
  }
  Vec best[G];
  for (int64_t g = 0; g < G; ++g) best[g] = Vec{} + kMasked;
  const IVec lane_key = [] { IVec l; for (int64_t i = 0; i < kLanes; ++i) l[i] = static_cast<int32_t>(i); return l; }();
  for (int64_t kb = 0; kb < n; kb += kLanes) {
    const Pairs* row[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) row[j] = reinterpret_cast<const Pairs*>(keys + rows[std::min(kb + j, n - 1)]);
    for (int64_t j = kb + kPrefetchKeys; j < std::min(kb + kPrefetchKeys + kLanes, n); ++j)
      for (int64_t line = 0; line < D * static_cast<int64_t>(sizeof(uint16_t)); line += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(keys + rows[j]) + line);
        __builtin_prefetch(reinterpret_cast<const char*>(values + rows[j]) + line);
      }
    const IVec real = lane_key < static_cast<int32_t>(n - kb);
    for (int64_t g = 0; g < G; ++g) {
      Vec acc[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) {
        Vec a{};
        for (int64_t c = 0; c < PV; ++c) madd_pairs(a, qp[g][c], load_pairs(row[j] + c * kLanes));
        acc[j] = a;
      }
      finish_scores(p, transpose_sum(acc), real, best[g], scores.data() + g * stride + kb);
    }
  }
  float inv_total[G];
  for (int64_t g = 0; g < G; ++g) {
    inv_total[g] = exp_scores(scores.data() + g * stride, stride, best[g], p.sinks[h * (p.heads / p.kv_heads) + g0 + g]);
    pairs_in_order(scores.data() + g * stride, stride / 2, scratch.weights.data() + g * stride / 2);  // zeros past n
  }
  // Weighted values, kValueBlock keys by 32 dimensions at a time (G x 2 accumulators): a pair of
  // keys past n has weight zero, and its second row repeats the last.
  constexpr int64_t kValueBlock = 32;
  const Pairs* weights = scratch.weights.data();
  Vec acc[G][2 * PV] = {};
  for (int64_t tb = 0; tb < n; tb += kValueBlock) {
    const int64_t te = std::min(tb + kValueBlock, n);
    for (int64_t c = 0; c < PV; ++c) {
      Vec a[G][2];
      for (int64_t g = 0; g < G; ++g) a[g][0] = acc[g][2 * c], a[g][1] = acc[g][2 * c + 1];
      for (int64_t t = tb; t < te; t += 2) {
        const __m512i v0 = _mm512_loadu_si512(values + rows[t] + 32 * c);
        const __m512i v1 = _mm512_loadu_si512(values + rows[std::min(t + 1, n - 1)] + 32 * c);
        IVec lo, hi;
        const __m512i lo_bits = _mm512_unpacklo_epi16(v0, v1), hi_bits = _mm512_unpackhi_epi16(v0, v1);
        __builtin_memcpy(&lo, &lo_bits, sizeof(lo));
        __builtin_memcpy(&hi, &hi_bits, sizeof(hi));
        for (int64_t g = 0; g < G; ++g) {
          const IVec w = splat(weights[g * stride / 2 + t / 2]);
          madd_pairs(a[g][0], w, lo);
          madd_pairs(a[g][1], w, hi);
        }
      }
      for (int64_t g = 0; g < G; ++g) acc[g][2 * c] = a[g][0], acc[g][2 * c + 1] = a[g][1];
    }
  }
  // lo's lane 4i + r holds dimension 8i + r and hi's 8i + 4 + r (r < 4): back in order.
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < PV; ++c) {
      const Vec lo = acc[g][2 * c], hi = acc[g][2 * c + 1];
      float* o = out + g * D + 32 * c;
      store(o, __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23) * inv_total[g]);
      store(o + kLanes,
            __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31) * inv_total[g]);
    }
}
#endif

// One (sequence, kv head) item, its query heads in groups of at most kMaxGroup; kPairs: bf16
// products (`attend_pairs`).
template <typename T, int64_t C, bool kPairs>
void attend_item(const Problem& p, int64_t b, int64_t h, DecodeScratch& scratch) {
  const int64_t group = p.heads / p.kv_heads;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
    const int64_t g = std::min(kMaxGroup, group - g0);
#if JAXSERVE_DPBF16
    if constexpr (kPairs) {
      switch (g) {
        case 1: attend_pairs<C, 1>(p, b, h, g0, scratch); break;
        case 2: attend_pairs<C, 2>(p, b, h, g0, scratch); break;
        case 3: attend_pairs<C, 3>(p, b, h, g0, scratch); break;
        default: attend_pairs<C, 4>(p, b, h, g0, scratch); break;
      }
      continue;
    }
#endif
    switch (g) {
      case 1: attend<T, C, 1>(p, b, h, g0, scratch); break;
      case 2: attend<T, C, 2>(p, b, h, g0, scratch); break;
      case 3: attend<T, C, 3>(p, b, h, g0, scratch); break;
      default: attend<T, C, 4>(p, b, h, g0, scratch); break;
    }
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> lengths,
                           ffi::Buffer<ffi::F32> sinks, float scale,
                           float soft_cap, int32_t window, int32_t bf16_products, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto cd = k_cache.dimensions();
  const auto td = block_tables.dimensions();
  int64_t row_extra = 0;
  if (!with_kv_type(k_cache.element_type(), row_extra, [](auto) {})) {
    return ffi::Error::InvalidArgument("paged decode: unsupported cache dtype");
  }
  if (qd.size() != 3 || td.size() != 2 || td[0] != qd[0] || !caches_match(k_cache, v_cache, qd[2], row_extra) ||
      qd[1] % cd[1] != 0 || lengths.element_count() != static_cast<size_t>(qd[0]) ||
      sinks.element_count() != static_cast<size_t>(qd[1])) {
    return ffi::Error::InvalidArgument("paged decode: inconsistent shapes");
  }
  Problem p{q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), block_tables.typed_data(),
            lengths.typed_data(), sinks.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], cd[1], cd[2], cd[3], td[1],
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
  bool served = false;
  with_kv_type(k_cache.element_type(), row_extra, [&](auto element) {
    using T = decltype(element);
    served = with_head_dim(p.dim, [&](auto chunks) {
      // A unit is one (sequence, kv head); the cost counts each K/V element read as 16 multiply-adds.
      constexpr int64_t C = decltype(chunks)::value;
      // bf16 pairs for bf16 queries on a bf16 cache where the CPU multiplies them in one instruction.
      constexpr bool kPairable = JAXSERVE_DPBF16 && std::is_same_v<T, uint16_t> && C % 2 == 0;
      const bool pairs = kPairable && bf16_products != 0;
      parallel_units(pool, items, 16 * 2 * rows * p.kv_heads * p.dim, [&](int64_t i) {
        thread_local DecodeScratch scratch;
        if (pairs) {
          attend_item<T, C, kPairable>(p, i / p.kv_heads, i % p.kv_heads, scratch);
        } else {
          attend_item<T, C, false>(p, i / p.kv_heads, i % p.kv_heads, scratch);
        }
      });
    });
  });
  if (!served) return ffi::Error::InvalidArgument("paged decode: head_dim must be a multiple of 16, at most 256");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_cache
                                  .Arg<ffi::AnyBuffer>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Attr<int32_t>("bf16_products")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// ---- Ragged prefill attention ------------------------------------------------------------
//
// q [T, H, D]: rows query_start[s]..query_start[s + 1] are sequence s's newest rows, causal
// over its seq_lens[s] tokens. An item is a tile of kTileQueries query vectors (row, head) of one
// sequence and one kv head, in lanes: the G heads of a row, then the next row's. It walks the
// keys kKeyBlock at a time with an online softmax, as two small matrix products: scores
// S^T [keys x queries] = K Q^T from register tiles of kKeyTile keys x kTileVecs vectors (a key
// element broadcast against a vector of queries), then O^T [dim x queries] += V^T P^T the same
// way. Q^T, O^T and the score block stay in L1; K and V rows are read in place.

namespace {

constexpr int64_t kTileVecs = 2;                    // vectors of queries per tile
constexpr int64_t kTileQueries = kTileVecs * kLanes;
constexpr int64_t kKeyTile = 8;                     // keys (or head dims) per register tile
constexpr int64_t kKeyBlock = 64;                   // keys per online-softmax step

struct Ragged {
  const float* q;
  const void* k;  // of the kernel's element type
  const void* v;
  const int32_t* tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const float* sinks;  // [H]
  float* out;
  int64_t heads, dim, kv_heads, pages, block_size, width, layer;
  float scale, soft_cap;
  int32_t window;
};

struct Tile {
  int64_t seq, first_query, num_queries;  // query vectors: (row, head-in-group) pairs, row-major
};

// Scratch of one thread: Q^T and O^T [D][kTileQueries], scores [kKeyBlock][kTileQueries], the
// offsets of the tile's keys, and a key block's K and V rows as f32 [kKeyBlock][D] (a cache of
// another format: each row is read from memory once per block, widened and scaled, then from L1).
struct PrefillScratch {
  std::vector<float> qt, ot, st, kf, vf;
  std::vector<Pairs> qp, kp, vp, pp;  // bf16 products: Q^T, K, V^T and P^T as pairs
  std::vector<int64_t> rows;
};

// A key row as bf16 pairs along the head dimension (a bf16 cache's row is read in place).
// (Values become pairs along the keys in `prefill_tile`: vp[t][d] holds values 2t and 2t + 1 of
// dimension d, built a vector of dimensions at a time.)
template <typename T, int64_t D>
const Pairs* key_pairs(const T* row, float* widened, Pairs* scratch) {
  if constexpr (std::is_same_v<T, uint16_t> && !kScaled<T>) {
    return reinterpret_cast<const Pairs*>(row);
  } else {
    pairs_in_order(row_as_f32<T, D>(row, widened), D / 2, scratch);
    return scratch;
  }
}

template <typename T, int64_t C, bool kPairs>
void prefill_tile(const Ragged& p, const Tile& tile, int64_t h, PrefillScratch& scratch) {
  constexpr int64_t D = C * kDimStep;
  constexpr int64_t R = D + kRowExtra<T>;  // elements per cache row
  // bf16 products on a bf16 cache: value pairs straight from the cache's bits (no widening).
  constexpr bool kBitPairs = kPairs && std::is_same_v<T, uint16_t>;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t s = tile.seq, q_len = p.query_start[s + 1] - p.query_start[s];
  const int64_t first_pos = p.seq_lens[s] - q_len;  // position of the sequence's first new row
  const int64_t row_lo = tile.first_query / group, row_hi = (tile.first_query + tile.num_queries - 1) / group;
  float* qt = scratch.qt.data();
  float* ot = scratch.ot.data();
  float* st = scratch.st.data();
  IVec pos[kTileVecs], real[kTileVecs];
  for (int64_t u = 0; u < kTileQueries; ++u) {
    const int64_t query = tile.first_query + u, row = query / group, head = h * group + query % group;
    const bool used = u < tile.num_queries;
    pos[u / kLanes][u % kLanes] = static_cast<int32_t>(first_pos + row);
    real[u / kLanes][u % kLanes] = used ? -1 : 0;
    const float* src = p.q + ((p.query_start[s] + row) * p.heads + head) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * kTileQueries + u] = used ? src[d] * p.scale : 0.0f;
  }
  Pairs* qp = scratch.qp.data();
  if constexpr (kPairs) {
    for (int64_t e = 0; e < D / 2; ++e)
      for (int64_t i = 0; i < kTileQueries; i += kLanes)
        store_pairs(qp + e * kTileQueries + i,
                    pair_lanes(load(qt + 2 * e * kTileQueries + i), load(qt + (2 * e + 1) * kTileQueries + i)));
  }
  std::fill(ot, ot + D * kTileQueries, 0.0f);
  const int64_t last_key = first_pos + row_hi;  // the tile's last row sees keys [0, last_key]
  const int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos + row_lo - p.window + 1) : 0;
  token_offsets(p.tables + s * p.width, p.block_size, R, key_lo, last_key + 1, scratch.rows);
  const int64_t slice = (p.layer * p.kv_heads + h) * p.pages * p.block_size * R;
  const T* keys = static_cast<const T*>(p.k) + slice;
  const T* values = static_cast<const T*>(p.v) + slice;
  // The online softmax starts from each query's sink: a key of logit sink and value zero.
  Vec m[kTileVecs], l[kTileVecs];
  for (int64_t u = 0; u < kTileQueries; ++u) {
    const float sink = p.sinks[h * group + (tile.first_query + u) % group];
    m[u / kLanes][u % kLanes] = sink;
    l[u / kLanes][u % kLanes] = sink > kMasked ? 1.0f : 0.0f;
  }
  for (int64_t kb = key_lo; kb <= last_key; kb += kKeyBlock) {
    const int64_t nb = std::min<int64_t>(kKeyBlock, last_key + 1 - kb);
    const float* krow[kKeyBlock];
    const float* vrow[kKeyBlock];  // values as f32 (but for bf16 pairs from a bf16 cache's bits)
    const T* vsrc[kKeyBlock];      // the values' cache rows
    const Pairs* kpair[kKeyBlock];
    for (int64_t j = 0; j < kKeyBlock; ++j) {  // a block's tail repeats its last key (masked below)
      if (j >= nb) {
        vsrc[j] = vsrc[nb - 1];
        if constexpr (!kBitPairs) vrow[j] = vrow[nb - 1];
        if constexpr (kPairs) {
          kpair[j] = kpair[nb - 1];
        } else {
          krow[j] = krow[nb - 1];
        }
        continue;
      }
      const int64_t row = scratch.rows[kb - key_lo + j];
      vsrc[j] = values + row;
      if constexpr (kPairs) {
        kpair[j] = key_pairs<T, D>(keys + row, scratch.kf.data() + j * D, scratch.kp.data() + j * D / 2);
        if constexpr (!kBitPairs) vrow[j] = row_as_f32<T, D>(values + row, scratch.vf.data() + j * D);
      } else {
        krow[j] = row_as_f32<T, D>(keys + row, scratch.kf.data() + j * D);
        vrow[j] = row_as_f32<T, D>(values + row, scratch.vf.data() + j * D);
      }
    }
    // S^T = K Q^T, kKeyTile keys at a time.
    for (int64_t j0 = 0; j0 < nb; j0 += kKeyTile) {
      Vec acc[kKeyTile][kTileVecs] = {};
      if constexpr (kPairs) {
        for (int64_t e = 0; e < D / 2; ++e) {
          IVec qe[kTileVecs];
          for (int64_t i = 0; i < kTileVecs; ++i) qe[i] = load_pairs(qp + e * kTileQueries + i * kLanes);
          for (int64_t j = 0; j < kKeyTile; ++j) {
            const IVec ke = splat(kpair[j0 + j][e]);
            for (int64_t i = 0; i < kTileVecs; ++i) madd_pairs(acc[j][i], ke, qe[i]);
          }
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          Vec qd[kTileVecs];
          for (int64_t i = 0; i < kTileVecs; ++i) qd[i] = load(qt + d * kTileQueries + i * kLanes);
          for (int64_t j = 0; j < kKeyTile; ++j) {
            const Vec kd = Vec{} + krow[j0 + j][d];
            for (int64_t i = 0; i < kTileVecs; ++i) acc[j][i] += kd * qd[i];
          }
        }
      }
      for (int64_t j = 0; j < kKeyTile; ++j)
        for (int64_t i = 0; i < kTileVecs; ++i) store(st + (j0 + j) * kTileQueries + i * kLanes, acc[j][i]);
    }
    // Mask, then the online softmax's rescaling.
    Vec block_max[kTileVecs];
    for (int64_t i = 0; i < kTileVecs; ++i) block_max[i] = Vec{} + kMasked;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t kpos = static_cast<int32_t>(kb + j);
      for (int64_t i = 0; i < kTileVecs; ++i) {
        Vec sc = load(st + j * kTileQueries + i * kLanes);
        if (p.soft_cap > 0.0f) sc = p.soft_cap * tanh(sc / p.soft_cap);
        IVec valid = (kpos <= pos[i]) & real[i];
        if (p.window > 0) valid &= kpos > pos[i] - p.window;
        sc = valid ? sc : Vec{} + kMasked;
        block_max[i] = max(block_max[i], sc);
        store(st + j * kTileQueries + i * kLanes, sc);
      }
    }
    Vec m_new[kTileVecs], alpha[kTileVecs];
    for (int64_t i = 0; i < kTileVecs; ++i) {
      m_new[i] = max(m[i], block_max[i]);
      alpha[i] = exp(m[i] - m_new[i]);
      l[i] *= alpha[i];
      m[i] = m_new[i];
    }
    for (int64_t j = 0; j < kKeyBlock; ++j) {  // P^T; zeros past nb, so the PV tiles need no tail
      for (int64_t i = 0; i < kTileVecs; ++i) {
        float* at = st + j * kTileQueries + i * kLanes;
        const Vec sc = j < nb ? load(at) : Vec{} + kMasked;
        const Vec e = sc > kMasked ? exp(sc - m_new[i]) : Vec{};
        l[i] += e;
        store(at, e);
      }
    }
    // O^T = alpha O^T + V^T P^T, kKeyTile head dims at a time.
    const int64_t nb_tiles = (nb + kKeyTile - 1) / kKeyTile * kKeyTile;
    const int64_t nb_pairs = (nb + 1) / 2;
    Pairs* pp = scratch.pp.data();
    Pairs* vp = scratch.vp.data();
    if constexpr (kPairs) {  // P^T and V^T as pairs of keys (P is zero past nb)
      for (int64_t t = 0; t < nb_pairs; ++t) {
        for (int64_t i = 0; i < kTileQueries; i += kLanes)
          store_pairs(pp + t * kTileQueries + i,
                      pair_lanes(load(st + 2 * t * kTileQueries + i), load(st + (2 * t + 1) * kTileQueries + i)));
        for (int64_t d = 0; d < D; d += kLanes) {
          if constexpr (kBitPairs) {
            store_pairs(vp + t * D + d, pair_bits(vsrc[2 * t] + d, vsrc[2 * t + 1] + d));
          } else {
            store_pairs(vp + t * D + d, pair_lanes(load(vrow[2 * t] + d), load(vrow[2 * t + 1] + d)));
          }
        }
      }
    }
    for (int64_t d0 = 0; d0 < D; d0 += kKeyTile) {
      Vec acc[kKeyTile][kTileVecs];
      for (int64_t d = 0; d < kKeyTile; ++d)
        for (int64_t i = 0; i < kTileVecs; ++i) acc[d][i] = load(ot + (d0 + d) * kTileQueries + i * kLanes) * alpha[i];
      if constexpr (kPairs) {
        for (int64_t t = 0; t < nb_pairs; ++t) {
          IVec pt[kTileVecs];
          for (int64_t i = 0; i < kTileVecs; ++i) pt[i] = load_pairs(pp + t * kTileQueries + i * kLanes);
          for (int64_t d = 0; d < kKeyTile; ++d) {
            const IVec vd = splat(vp[t * D + d0 + d]);
            for (int64_t i = 0; i < kTileVecs; ++i) madd_pairs(acc[d][i], vd, pt[i]);
          }
        }
      } else {
        for (int64_t j = 0; j < nb_tiles; ++j) {
          Vec pj[kTileVecs];
          for (int64_t i = 0; i < kTileVecs; ++i) pj[i] = load(st + j * kTileQueries + i * kLanes);
          for (int64_t d = 0; d < kKeyTile; ++d) {
            const Vec vd = Vec{} + vrow[j][d0 + d];
            for (int64_t i = 0; i < kTileVecs; ++i) acc[d][i] += vd * pj[i];
          }
        }
      }
      for (int64_t d = 0; d < kKeyTile; ++d)
        for (int64_t i = 0; i < kTileVecs; ++i) store(ot + (d0 + d) * kTileQueries + i * kLanes, acc[d][i]);
    }
  }
  for (int64_t u = 0; u < tile.num_queries; ++u) {
    const int64_t query = tile.first_query + u, row = query / group, head = h * group + query % group;
    float* dst = p.out + ((p.query_start[s] + row) * p.heads + head) * D;
    const float inv = 1.0f / l[u / kLanes][u % kLanes];
    for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * kTileQueries + u] * inv;
  }
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                            ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                            ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::F32> sinks, float scale,
                            float soft_cap, int32_t window,
                            int32_t bf16_products, ffi::ResultBuffer<ffi::F32> out) {
  // bf16 pairs only where the CPU multiplies them in one instruction (elsewhere they cost more than f32).
  const bool pairs = bf16_products != 0 && JAXSERVE_DPBF16;
  const auto qd = q.dimensions();
  const auto cd = k_cache.dimensions();
  const auto td = block_tables.dimensions();
  const int64_t num_seqs = td.size() == 2 ? td[0] : -1;
  int64_t row_extra = 0;
  if (!with_kv_type(k_cache.element_type(), row_extra, [](auto) {})) {
    return ffi::Error::InvalidArgument("paged prefill: unsupported cache dtype");
  }
  if (qd.size() != 3 || td.size() != 2 || !caches_match(k_cache, v_cache, qd[2], row_extra) || qd[1] % cd[1] != 0 ||
      seq_lens.element_count() != static_cast<size_t>(num_seqs) ||
      query_start.element_count() != static_cast<size_t>(num_seqs + 1) ||
      sinks.element_count() != static_cast<size_t>(qd[1])) {
    return ffi::Error::InvalidArgument("paged prefill: inconsistent shapes");
  }
  Ragged p{q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), block_tables.typed_data(),
           seq_lens.typed_data(), query_start.typed_data(), sinks.typed_data(), out->typed_data(), qd[1], qd[2], cd[1], cd[2], cd[3],
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
    const int64_t queries = (hi - lo) * (p.heads / p.kv_heads);
    for (int64_t u = 0; u < queries; u += kTileQueries) tiles.push_back({s, u, std::min(kTileQueries, queries - u)});
    work += (hi - lo) * length;
  }
  // Rows no sequence owns (the step's padding) are zeros.
  const int64_t covered = num_seqs > 0 ? p.query_start[num_seqs] : 0;
  std::fill(p.out + covered * p.heads * p.dim, p.out + qd[0] * p.heads * p.dim, 0.0f);
  const int64_t items = static_cast<int64_t>(tiles.size()) * p.kv_heads;
  bool served = false;
  with_kv_type(k_cache.element_type(), row_extra, [&](auto element) {
    using T = decltype(element);
    served = with_head_dim(p.dim, [&](auto chunks) {
      constexpr int64_t D = decltype(chunks)::value * kDimStep;
      // A unit is one tile of one kv head; the cost is the multiply-adds of QK^T and PV.
      parallel_units(pool, items, 2 * work * p.heads * p.dim, [&](int64_t i) {
        thread_local PrefillScratch scratch;
        scratch.qt.resize(D * kTileQueries);
        scratch.ot.resize(D * kTileQueries);
        scratch.st.resize(kKeyBlock * kTileQueries);
        scratch.kf.resize(kKeyBlock * D);
        scratch.vf.resize(kKeyBlock * D);
        if (pairs) {
          scratch.qp.resize(D / 2 * kTileQueries);
          scratch.kp.resize(kKeyBlock * D / 2);
          scratch.vp.resize(D * kKeyBlock / 2);
          scratch.pp.resize(kKeyBlock / 2 * kTileQueries);
          prefill_tile<T, decltype(chunks)::value, true>(p, tiles[i / p.kv_heads], i % p.kv_heads, scratch);
        } else {
          prefill_tile<T, decltype(chunks)::value, false>(p, tiles[i / p.kv_heads], i % p.kv_heads, scratch);
        }
      });
    });
  });
  if (!served) return ffi::Error::InvalidArgument("paged prefill: head_dim must be a multiple of 16, at most 256");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedPrefill, PagedPrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_cache
                                  .Arg<ffi::AnyBuffer>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Attr<int32_t>("bf16_products")
                                  .Ret<ffi::Buffer<ffi::F32>>());
