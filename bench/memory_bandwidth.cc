// Memory bandwidth of this machine for the weight-bandwidth floor (`python3 -m bench.memory_bandwidth`):
// `threads` threads each stream their part of a buffer of `mib` MiB, `reps` times: reading it
// (a sum, as a matmul streams its weights) and copying it to a second buffer (read + write).
// Prints "read_bps copy_bps", the best of the repetitions, bytes per second (copy: read + written).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using Vec = float __attribute__((vector_size(64)));


int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t bytes = (argc > 2 ? std::atoll(argv[2]) : 1024) << 20;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const size_t n = bytes / sizeof(Vec);
  std::vector<Vec> a(n), b(n);
  for (size_t i = 0; i < n; ++i) a[i] = Vec{} + static_cast<float>(i & 7);
  std::vector<float> sink(threads * 16);
  double best_read = 0, best_copy = 0;
  for (int r = 0; r < reps; ++r) {
    auto run = [&](auto body) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
      for (auto& th : pool) th.join();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    const double read_s = run([&](int t) {
      Vec s0{}, s1{}, s2{}, s3{};
      const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
      for (size_t i = lo; i + 4 <= hi; i += 4) {
        s0 += a[i]; s1 += a[i + 1]; s2 += a[i + 2]; s3 += a[i + 3];
      }
      const Vec s = s0 + s1 + s2 + s3;
      std::memcpy(&sink[t * 16], &s, sizeof(s));
    });
    const double copy_s = run([&](int t) {
      const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
      std::memcpy(&b[lo], &a[lo], (hi - lo) * sizeof(Vec));
    });
    best_read = std::max(best_read, bytes / read_s);
    best_copy = std::max(best_copy, 2.0 * bytes / copy_s);
  }
  std::printf("%.4g %.4g %g\n", best_read, best_copy, sink[0] + b[n / 2][0]);
  return 0;
}
