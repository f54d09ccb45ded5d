// Arithmetic peak of this machine, the denominator of a matmul's floor (`python3 -m bench.compute_peak`):
// `threads` threads each run twelve independent chains of 512-bit multiply-adds on registers (no
// memory traffic): f32 fused multiply-adds (16 lanes x 2 FLOP) and, where the CPU has AVX512-BF16,
// bf16 pair dot products (vdpbf16ps: 16 lanes x 2 pairs x 2 FLOP). Prints "f32_flops bf16_flops" per
// second, the best of `reps` repetitions; bf16 is 0 without AVX512-BF16.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

constexpr int kChains = 12;  // independent accumulators: at least latency x issue width

// Twelve named accumulators `a0`..`a11`, each `OP(acc)`-ed per iteration, kept in registers.
#define CHAINS(OP)                                                                                  \
  OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); OP(a6); OP(a7); OP(a8); OP(a9); OP(a10); OP(a11); \
  asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));                   \
  asm volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11))
#define DECLARE(init) __m512 a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, \
  a6 = init, a7 = init, a8 = init, a9 = init, a10 = init, a11 = init
#define SUM (a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11)

template <typename Body>
double run(int threads, long iters, Body body) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(body, t, iters);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const long iters = argc > 2 ? std::atol(argv[2]) : 20000000;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::vector<float> sink(threads);
  auto f32 = [&](int t, long n) {
    DECLARE(_mm512_set1_ps(0.001f * t));
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-6f);
    for (long i = 0; i < n; ++i) {
#define FMA(x) x = _mm512_fmadd_ps(x, a, b)
      CHAINS(FMA);
    }
    sink[t] = _mm512_reduce_add_ps(SUM);
  };
  double f32_best = 0, bf16_best = 0;
  for (int r = 0; r < reps; ++r) f32_best = std::max(f32_best, threads * iters * kChains * 32.0 / run(threads, iters, f32));
#ifdef __AVX512BF16__
  auto bf16 = [&](int t, long n) {
    DECLARE(_mm512_set1_ps(0.001f * t));
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-6f), _mm512_set1_ps(2e-6f));
    for (long i = 0; i < n; ++i) {
#define DOT(x) x = _mm512_dpbf16_ps(x, a, b)
      CHAINS(DOT);
    }
    sink[t] = _mm512_reduce_add_ps(SUM);
  };
  for (int r = 0; r < reps; ++r) bf16_best = std::max(bf16_best, threads * iters * kChains * 64.0 / run(threads, iters, bf16));
#endif
  std::printf("%.4g %.4g %g\n", f32_best, bf16_best, sink[0]);
  return 0;
}
