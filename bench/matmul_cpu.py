"""The cpu matmuls (`kernels_pallas/cpu_matmul.cc`) in f32 and bf16 against XLA's dots, at the
row counts of decode and prefill steps: the layer matmul (on weights in its panels) against
XLA's dot of the [K, N] layout, each in a scan over a 30-layer stack of the default model's
shapes (what the model's layer loop does), and the head tied to the embedding against XLA's
x @ embedding.T:

    python3 -m bench.matmul_cpu [--rows 1 4 8 32 64 256]

Prints, per shape and row count, the f32 kernel's, the bf16 kernel's and XLA's f32 dot's time
for the 30 layers, the weights' bytes over each kernel's time (the floor at few rows is memory
bandwidth: compare a copy's, printed first), the bf16 kernel's FLOP rate (the floor at many
rows), and the ratios: f32 kernel / bf16 kernel (above 1: bf16 is faster) and XLA / f32 kernel;
then both ratios over the four shapes of a layer together; then the same for the tied head
(f32: the kernel where the model calls it, XLA's dot above `cpu_matmul.HEAD_MAX_ROWS`; bf16: the
kernel, against XLA's bf16 dot too). The machines are shared and noisy: the variants alternate,
call by call, and each takes its best round.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_bench import copy_bandwidth
from kernels_pallas import cpu_matmul

LAYERS = 30
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # q/o, k/v, gate/up, down (K, N)
VOCAB = 49152  # the tied head: x [M, 576] @ embedding [VOCAB, 576].T


def alternated(
    fns: list[Callable[[], jax.Array]], iters: int, rounds: int = 3, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Seconds per call of each of `fns` (compiled first): in each round each runs `iters` calls
    back to back, one after the other; each keeps its best round's mean. Alternating them puts
    every variant through the same spells of load from other processes. `clock`: wall time, or
    `time.process_time` (this process's CPU time, all its threads: what the work itself took
    where other processes crowd the cores)."""
    for fn in fns:
        jax.block_until_ready(fn())
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = clock()
            out = None
            for _ in range(iters):
                out = fn()
            jax.block_until_ready(out)
            best[i] = min(best[i], (clock() - start) / iters)
    return best


def layer_matmuls(args: argparse.Namespace, matmul: cpu_matmul.CpuMatmul) -> None:
    kernel = jax.jit(lambda x, w: jax.lax.scan(lambda c, i: (c, matmul(x, w, i)), 0, jnp.arange(LAYERS))[1])
    xla = jax.jit(lambda x, w: jax.lax.scan(lambda c, i: (c, x @ w[i]), 0, jnp.arange(LAYERS))[1])
    totals = {m: [0.0, 0.0, 0.0] for m in args.rows}
    print(
        f"{'K x N':>11} {'rows':>5} {'f32 ms':>8} {'GB/s':>6} {'bf16 ms':>8} {'GB/s':>6} {'GFLOP/s':>8} "
        f"{'XLA ms':>8} {'f32/bf16':>8} {'XLA/f32':>8}"
    )
    for k, n in SHAPES:
        w = jnp.asarray(np.random.default_rng(0).standard_normal((LAYERS, k, n), np.float32))
        panels = cpu_matmul.to_panels(w, matmul.panel)
        bf16_panels = cpu_matmul.to_panels(w.astype(jnp.bfloat16), matmul.panel)
        for m in args.rows:
            x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k), np.float32))
            f32, bf16, theirs = alternated(
                [lambda: kernel(x, panels), lambda: kernel(x, bf16_panels), lambda: xla(x, w)], args.iters
            )
            for i, t in enumerate((f32, bf16, theirs)):
                totals[m][i] += t
            nbytes, flops = 4 * LAYERS * k * n, 2 * LAYERS * m * k * n
            print(
                f"{k:>5} x {n:<4} {m:>5} {f32 * 1e3:>8.2f} {nbytes / f32 / 1e9:>6.1f} {bf16 * 1e3:>8.2f} "
                f"{nbytes / 2 / bf16 / 1e9:>6.1f} {flops / bf16 / 1e9:>8.1f} {theirs * 1e3:>8.2f} "
                f"{f32 / bf16:>8.2f} {theirs / f32:>8.2f}"
            )
    for m, (f32, bf16, theirs) in totals.items():
        print(f"{m} rows, a layer's four shapes: f32/bf16 {f32 / bf16:.2f}, XLA/f32 {theirs / f32:.2f}")


def tied_head(args: argparse.Namespace, matmul: cpu_matmul.CpuMatmul) -> None:
    embedding = jnp.asarray(np.random.default_rng(0).standard_normal((VOCAB, 576), np.float32))
    bf16_embedding = embedding.astype(jnp.bfloat16)
    head, xla_head = jax.jit(matmul.head), jax.jit(lambda x, e: x @ e.T)
    xla_bf16 = jax.jit(lambda x, e: jnp.matmul(x.astype(e.dtype), e.T, preferred_element_type=jnp.float32))
    for m in args.rows:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((m, 576), np.float32))
        f32_kernel = matmul.takes_head(x, embedding)  # else the model uses XLA's dot (HEAD_MAX_ROWS)
        f32, bf16, theirs = alternated(
            [
                lambda: (head if f32_kernel else xla_head)(x, embedding),
                lambda: head(x, bf16_embedding),
                lambda: xla_bf16(x, bf16_embedding),
            ],
            args.iters,
        )
        print(
            f"tied head {m:>4} rows: f32 {'kernel' if f32_kernel else 'XLA'} {f32 * 1e3:7.2f} ms "
            f"({embedding.nbytes / f32 / 1e9:5.1f} GB/s), bf16 kernel {bf16 * 1e3:7.2f} ms "
            f"({bf16_embedding.nbytes / bf16 / 1e9:5.1f} GB/s, {2 * m * embedding.size / bf16 / 1e9:6.1f} GFLOP/s), "
            f"XLA bf16 {theirs * 1e3:7.2f} ms; f32/bf16 {f32 / bf16:.2f}, XLA bf16/bf16 kernel {theirs / bf16:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 64, 256])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    matmul = cpu_matmul.kernels()
    bf16_by = "AVX512-BF16 dot products" if cpu_matmul.bf16_dot() else "widening to f32"
    print(
        f"panel width {matmul.panel}; bf16 by {bf16_by}; "
        f"copy: {copy_bandwidth(1 << 28, jnp.float32, args.iters) / 1e9:.1f} GB/s (read + write)"
    )
    layer_matmuls(args, matmul)
    tied_head(args, matmul)


if __name__ == "__main__":
    main()
