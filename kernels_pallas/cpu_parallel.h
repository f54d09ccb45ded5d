// Work split over XLA's intra-op threads for the CPU kernels (cpu_attention.cc, cpu_matmul.cc),
// through the FFI's thread pool: no thread is started per call.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace {

// Runs unit(u) for u in [0, units) on the caller and up to `workers` - 1 pool threads, which
// claim units one at a time from a shared counter: a worker that starts late (or shares its
// core) takes less, and the call never waits on a task still queued. `cost`: multiply-adds of
// the call, counting a float read from memory as 16 of them (what one thread streams in that
// time); a worker for at least ~1M of them, since below that a pool thread's wake-up costs more.
template <typename F>
void parallel_units(xla::ffi::ThreadPool& pool, int64_t units, int64_t cost, F unit) {
  struct Shared {
    explicit Shared(F f) : unit(std::move(f)) {}
    F unit;
    int64_t units;
    std::atomic<int64_t> next{0}, finished{0};
  };
  auto shared = std::make_shared<Shared>(std::move(unit));
  shared->units = units;
  const int64_t workers = std::max<int64_t>(1, std::min({units, pool.num_threads() + 1, cost >> 20}));
  auto work = [](Shared& s) {
    for (int64_t u; (u = s.next.fetch_add(1)) < s.units;) {
      s.unit(u);
      s.finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  // Wait for the units, not the workers: one that starts after the last unit was claimed finds
  // none and leaves, holding only `shared` (the buffers may be gone by then).
  while (shared->finished.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

}  // namespace
