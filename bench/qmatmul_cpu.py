"""The quantized layer matmuls (`kernels_pallas/cpu_qmatmul.cc`) against the bf16 (and f32) layer
matmuls (`cpu_matmul.cc`), each in a scan over a stack of a model's four layer shapes (what the
model's layer loop does):

    python3 -m bench.qmatmul_cpu [--shapes default|qwen0.5b] [--rows 1 8 32 128 512] [--layers 30]

Formats: `f32`, `bf16` (weights as the model stores them); `int8` (per channel), `q4` (groups of
32), `gguf-q4_1` and `gguf-q8_0` (real GGUF blocks, `gguf.quants.quantize`, repacked as served by
`--quantization gguf`), each with `:f32` products (what an f32 model computes, and every row count
before the bf16 path) or `:bf16` ones (a bf16 model: from `cpu_qmatmul.panel_rows` rows, the
dequantized weights and x rounded to bf16, the bf16 layer matmul's tiles). The activations are f32,
as the model gives them. Prints, per row count, each format's time for the whole stack (the four
shapes together) and its time over bf16's; with `--floors`, each one's time over its floor:
max(its weight bytes / read bandwidth, FLOPs / bf16 peak), both measured after that row count
(`bench.memory_bandwidth`, `bench.compute_peak`). Variants alternate call by
call (`bench.matmul_cpu.alternated`): the machines are shared and noisy; on a crowded one
`--cpu-time` times the process's CPU seconds (its threads' work) instead of wall time.
"""

from __future__ import annotations

import argparse
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from bench import compute_peak, memory_bandwidth
from bench.matmul_cpu import alternated
from checkpoints.gguf_blocks import FORMATS as GGUF_FORMATS
from checkpoints.gguf_blocks import block_arrays, stored_arrays
from checkpoints.quant_format import QuantFormat
from checkpoints.quantize import quantize_kernel
from kernels_pallas import cpu_matmul, cpu_qmatmul

SHAPES = {  # a layer's four matmul shapes (K, N): gate/up, down, q/o, k/v
    "default": [(576, 1536), (1536, 576), (576, 576), (576, 192)],  # SmolLM2-135M
    "qwen0.5b": [(896, 4864), (4864, 896), (896, 896), (896, 128)],  # Qwen2.5-0.5B
}
QUANTIZED = {"int8": None, "q4": QuantFormat(4, 32), "gguf-q4_1": gguf.GGMLQuantizationType.Q4_1}
QUANTIZED["gguf-q8_0"] = gguf.GGMLQuantizationType.Q8_0
DEFAULT_FORMATS = ["bf16", "int8:f32", "int8:bf16", "q4:f32", "q4:bf16", "gguf-q4_1:bf16"]


def quantized_layer(w: np.ndarray, kind: str) -> tuple[dict[str, np.ndarray], QuantFormat]:
    """One layer's weights [K, N] as `kind` stores them: the quantizer's arrays, or a GGUF type's
    blocks (of the [N, K] tensor, as a file holds it) repacked."""
    spec = QUANTIZED[kind]
    if not isinstance(spec, gguf.GGMLQuantizationType):
        fmt = spec or QuantFormat(8, w.shape[0])
        return {name: np.asarray(a) for name, a in quantize_kernel(jnp.asarray(w), fmt).items()}, fmt
    blocks = gguf.quants.quantize(np.ascontiguousarray(w.T), spec)
    return stored_arrays(block_arrays(blocks, spec), GGUF_FORMATS[spec]), GGUF_FORMATS[spec]


def stacks(shapes: list[tuple[int, int]], layers: int, formats: list[str], panel: int) -> dict[str, list]:
    """Per format, per shape: (its stacked weights as the kernels read them, its QuantFormat or None).
    The layers are copies of one random layer (distinct memory, as the timing needs)."""
    out = {name: [] for name in formats}
    for k, n in shapes:
        w = np.random.default_rng(0).standard_normal((k, n), np.float32) / np.sqrt(k)
        for name in formats:
            kind = name.split(":")[0]
            if kind in ("f32", "bf16"):
                stack = jnp.asarray(np.broadcast_to(w, (layers, k, n)), jnp.float32 if kind == "f32" else jnp.bfloat16)
                out[name].append((cpu_matmul.to_panels(stack, panel), None))
                continue
            arrays, fmt = quantized_layer(w, kind)
            stacked = {a: cpu_matmul.to_panels(jnp.asarray(np.stack([v] * layers)), panel) for a, v in arrays.items()}
            out[name].append((stacked, fmt))
    return out


def layer_loop(call, layers: int):
    """The shapes' matmuls over all layers; call(x, weights, layer, shape index)."""
    return jax.jit(
        lambda xs, ws: [
            jax.lax.scan(lambda c, i: (c, call(xs[j], w, i, j)), 0, jnp.arange(layers))[1] for j, w in enumerate(ws)
        ]
    )


def floors(nbytes: dict[str, int], flops: int) -> dict[str, float]:
    """Seconds per format of a call of `flops`: max(its weight bytes / read bandwidth, FLOPs / bf16
    peak), both measured now (`bench.memory_bandwidth`, `bench.compute_peak`)."""
    read, _ = memory_bandwidth.measure(2, 512, 3)
    f32_peak, bf16_peak = compute_peak.measure(2, 3)
    print(f"  floor: read {read / 1e9:.1f} GB/s, bf16 peak {bf16_peak / 1e9:.0f} GFLOP/s (f32 {f32_peak / 1e9:.0f})")
    return {name: max(b / read, flops / (bf16_peak or f32_peak)) for name, b in nbytes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--floors", action="store_true")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time this process's CPU seconds, not wall (a crowded machine)"
    )
    args = parser.parse_args()
    shapes, formats = SHAPES[args.shapes], args.formats
    panel = cpu_matmul.panel_width()
    weights = stacks(shapes, args.layers, formats, panel)
    matmul = cpu_matmul.kernels()
    loops = {}
    for name in formats:
        fmts = [fmt for _, fmt in weights[name]]
        products = jnp.bfloat16 if name.endswith(":bf16") else jnp.float32
        if fmts[0] is None:
            loops[name] = layer_loop(lambda x, w, i, j: matmul(x, w, i), args.layers)
        else:
            loops[name] = layer_loop(
                lambda x, w, i, j, f=fmts, d=products: cpu_qmatmul.layer_matmul(x, w, f[j], i, d), args.layers
            )
    arrays = {name: [w for w, _ in weights[name]] for name in formats}
    nbytes = {name: sum(a.nbytes for a in jax.tree.leaves(arrays[name])) for name in formats}
    base = "bf16" if "bf16" in formats else formats[0]
    print(f"{args.shapes} shapes {shapes}, {args.layers} layers; time / {base}'s (and / floor with --floors)")
    print(f"{'rows':>5}" + "".join(f" {f + ' ms':>17} {'/' + base:>6}" for f in formats))
    for m in args.rows:
        xs = [jnp.asarray(np.random.default_rng(1).standard_normal((m, k), np.float32)) for k, _ in shapes]
        calls = [lambda name=name: loops[name](xs, arrays[name]) for name in formats]
        clock = time.process_time if args.cpu_time else time.perf_counter
        times = dict(zip(formats, alternated(calls, args.iters, clock=clock)))
        print(f"{m:>5}" + "".join(f" {times[f] * 1e3:>17.2f} {times[f] / times[base]:>6.2f}" for f in formats))
        if args.floors:
            floor = floors(nbytes, 2 * m * sum(k * n for k, n in shapes) * args.layers)
            shares = (f"{f} {times[f] / floor[f]:.2f} ({floor[f] * 1e3:.2f} ms)" for f in formats)
            print("  time / floor: " + ", ".join(shares))


if __name__ == "__main__":
    main()
