"""The cpu matmuls (`kernels_pallas/cpu_matmul.cc`) against XLA's dots, at the row counts of
decode and prefill steps: the layer matmul (on weights in its panels) against XLA's dot of the
[K, N] layout, each in a scan over a 30-layer stack of the default model's shapes (what the
model's layer loop does), and the head tied to the embedding against XLA's x @ embedding.T:

    python3 -m bench.matmul_cpu [--rows 1 8 32 128 512]

Prints, per shape and row count, each one's time for the 30 layers, the weights' bytes over
that time (the floor at few rows is memory bandwidth: compare a copy's, printed first), the
FLOP rate (the floor at many rows), and XLA's time over the kernel's; then the ratio over the
four shapes of a layer together; then the same for the tied head, at the row counts it takes
(the model runs XLA's dot above `cpu_matmul.HEAD_MAX_ROWS`). The two alternate in one run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_bench import copy_bandwidth, time_call
from kernels_pallas import cpu_matmul

LAYERS = 30
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # q/o, k/v, gate/up, down (K, N)
VOCAB = 49152  # the tied head: x [M, 576] @ embedding [VOCAB, 576].T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    matmul = cpu_matmul.kernels()
    print(f"panel width {matmul.panel}; copy: {copy_bandwidth(1 << 28, jnp.float32, args.iters) / 1e9:.1f} GB/s "
          "(read + write)")
    kernel = jax.jit(lambda x, w: jax.lax.scan(lambda c, i: (c, matmul(x, w, i)), 0, jnp.arange(LAYERS))[1])
    xla = jax.jit(lambda x, w: jax.lax.scan(lambda c, i: (c, x @ w[i]), 0, jnp.arange(LAYERS))[1])
    totals = {m: [0.0, 0.0] for m in args.rows}
    print(f"{'K x N':>11} {'rows':>5} {'kernel ms':>10} {'GB/s':>6} {'GFLOP/s':>8} {'XLA ms':>8} {'GB/s':>6} "
          f"{'GFLOP/s':>8} {'XLA/kernel':>10}")
    for k, n in SHAPES:
        w = jnp.asarray(np.random.default_rng(0).standard_normal((LAYERS, k, n), np.float32))
        panels = cpu_matmul.to_panels(w, matmul.panel)
        for m in args.rows:
            x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k), np.float32))
            ours = time_call(lambda: kernel(x, panels), args.iters)
            theirs = time_call(lambda: xla(x, w), args.iters)
            totals[m][0] += ours
            totals[m][1] += theirs
            nbytes, flops = 4 * LAYERS * k * n, 2 * LAYERS * m * k * n
            print(f"{k:>5} x {n:<4} {m:>5} {ours * 1e3:>10.2f} {nbytes / ours / 1e9:>6.1f} {flops / ours / 1e9:>8.1f} "
                  f"{theirs * 1e3:>8.2f} {nbytes / theirs / 1e9:>6.1f} {flops / theirs / 1e9:>8.1f} {theirs / ours:>10.2f}")
    for m, (ours, theirs) in totals.items():
        print(f"{m} rows, a layer's four shapes: XLA/kernel {theirs / ours:.2f}")
    embedding = jnp.asarray(np.random.default_rng(0).standard_normal((VOCAB, 576), np.float32))
    head, xla_head = jax.jit(matmul.head), jax.jit(lambda x, e: x @ e.T)
    for m in args.rows:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((m, 576), np.float32))
        if not matmul.takes_head(x, embedding):
            continue  # the model uses XLA's dot there (cpu_matmul.HEAD_MAX_ROWS)
        ours = time_call(lambda: head(x, embedding), args.iters)
        theirs = time_call(lambda: xla_head(x, embedding), args.iters)
        print(f"tied head {m:>4} rows: kernel {ours * 1e3:7.2f} ms ({embedding.nbytes / ours / 1e9:5.1f} GB/s, "
              f"{2 * m * embedding.size / ours / 1e9:6.1f} GFLOP/s), XLA {theirs * 1e3:7.2f} ms, XLA/kernel {theirs / ours:.2f}")


if __name__ == "__main__":
    main()
