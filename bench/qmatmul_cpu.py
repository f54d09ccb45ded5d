"""The quantized layer matmuls (`kernels_pallas/cpu_qmatmul.cc`: int8 per output channel, 4 bits in
groups of 32) against the f32 and bf16 layer matmuls (`cpu_matmul.cc`), each in a scan over a
30-layer stack of the default model's four shapes (what the model's layer loop does):

    python3 -m bench.qmatmul_cpu [--rows 1 8 32 256]

Prints, per row count, each format's time for a whole layer stack (the four shapes together), its
weight bytes over that time, and its time over f32's. At few rows a step streams its weights, so
bytes per second against the machine's read bandwidth (`python3 -m bench.memory_bandwidth`) is the
share of the floor; at many rows the multiply-adds bound it. Variants alternate call by call
(`bench.matmul_cpu.alternated`): the machines are shared and noisy.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.matmul_cpu import LAYERS, SHAPES, alternated
from checkpoints.quant_format import QuantFormat
from checkpoints.quantize import quantize_kernel
from kernels_pallas import cpu_matmul, cpu_qmatmul

FORMATS = ("f32", "bf16", "int8", "q4")


def stacks(matmul: cpu_matmul.CpuMatmul) -> dict[str, list]:
    """Per format, the four shapes' stacked weights as the kernels read them."""
    out = {name: [] for name in FORMATS}
    for k, n in SHAPES:
        w = jnp.asarray(np.random.default_rng(0).standard_normal((LAYERS, k, n), np.float32) / np.sqrt(k))
        out["f32"].append(cpu_matmul.to_panels(w, matmul.panel))
        out["bf16"].append(cpu_matmul.to_panels(w.astype(jnp.bfloat16), matmul.panel))
        for name, fmt in (("int8", QuantFormat(8, k)), ("q4", QuantFormat(4, 32))):
            arrays = quantize_kernel(w, fmt)
            out[name].append(({a: cpu_matmul.to_panels(v, matmul.panel) for a, v in arrays.items()}, fmt))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    matmul = cpu_matmul.kernels()
    weights = stacks(matmul)

    def layer_loop(call):
        """The four shapes' matmuls over all layers; call(x, w, layer, shape index)."""
        return jax.jit(
            lambda x, ws: [
                jax.lax.scan(lambda c, i: (c, call(x[j], w, i, j)), 0, jnp.arange(LAYERS))[1] for j, w in enumerate(ws)
            ]
        )

    plain = layer_loop(lambda x, w, i, j: matmul(x, w, i))
    quantized = {
        name: layer_loop(lambda x, w, i, j, name=name: cpu_qmatmul.layer_matmul(x, w, weights[name][j][1], i))
        for name in ("int8", "q4")
    }
    arrays = {name: [w[0] if isinstance(w, tuple) else w for w in weights[name]] for name in FORMATS}  # no formats
    nbytes = {name: sum(a.nbytes for a in jax.tree.leaves(arrays[name])) for name in FORMATS}
    print(f"{'rows':>5}" + "".join(f" {name + ' ms':>9} {'GB/s':>6} {'/f32':>5}" for name in FORMATS))
    for m in args.rows:
        xs = [jnp.asarray(np.random.default_rng(1).standard_normal((m, k), np.float32)) for k, _ in SHAPES]
        calls = [lambda: plain(xs, arrays["f32"]), lambda: plain(xs, arrays["bf16"])]
        calls += [lambda name=name: quantized[name](xs, arrays[name]) for name in ("int8", "q4")]
        times = dict(zip(FORMATS, alternated(calls, args.iters)))
        print(
            f"{m:>5}"
            + "".join(
                f" {times[f] * 1e3:>9.2f} {nbytes[f] / times[f] / 1e9:>6.1f} {times[f] / times['f32']:>5.2f}"
                for f in FORMATS
            )
        )


if __name__ == "__main__":
    main()
