"""MLA prefill, one layer's attention at DeepSeek-V3's shapes: the absorbed form against prefill by
decompression, in the same run:

    python3 -m bench.mla_prefill                       # chunks of 256 rows after 0 and 256 cached tokens
    python3 -m bench.mla_prefill --rows 512 --prefix 0 1024 --heads 32

Absorbed: the queries taken into latent space (q_nope W_uk^T), `mla_reference.mla_prefill_attention`
over the latent rows, the output taken out by W_uv (what `LatentAttention` runs for a short prefill
step and for decode). Decompressed: `mla_decompressed.mla_decompressed_prefill` (long prefill steps).
f32, one sequence, a block table exactly as wide as prefix + rows. Prints each form's best time,
the FLOPs each computes (the reference scores every (row, key) pair of the table, masked after) and
the ratio decompressed / absorbed (below 1: decompression is faster).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.kernel_bench import time_call
from kernels_pallas import mla_reference
from kernels_pallas.mla_decompressed import mla_decompressed_prefill

RANK, NOPE, ROPE, V, BLOCK = 512, 128, 64, 128, 16


def case(heads: int, prefix: int, rows: int) -> tuple[jax.Array, ...]:
    """Random q_nope, q_pe, latent cache halves, layer, table, lengths, query starts and kv_b."""
    keys = jax.random.split(jax.random.key(0), 4)
    width = -(-(prefix + rows) // BLOCK)
    half = jax.random.normal(keys[0], (1, 1, width + 1, BLOCK, (RANK + ROPE) // 2), jnp.float32)
    kv_b = jax.random.normal(keys[1], (RANK, heads, NOPE + V), jnp.float32) * RANK**-0.5
    return (
        jax.random.normal(keys[2], (rows, heads, NOPE)),
        jax.random.normal(keys[3], (rows, heads, ROPE)),
        half,
        half,
        jnp.int32(0),
        jnp.arange(1, width + 1, dtype=jnp.int32)[None],
        jnp.array([prefix + rows], jnp.int32),
        jnp.array([0, rows], jnp.int32),
        kv_b,
    )


@jax.jit
def absorbed(q_nope, q_pe, k_cache, v_cache, layer, tables, lengths, starts, kv_b) -> jax.Array:
    q = jnp.concatenate([jnp.einsum("thn,rhn->thr", q_nope, kv_b[..., :NOPE]), q_pe], axis=-1)
    out = mla_reference.mla_prefill_attention(
        q, k_cache, v_cache, layer, tables, lengths, starts, scale=0.07, latent_dim=RANK
    )
    return jnp.einsum("thr,rhv->thv", out, kv_b[..., NOPE:])


decompressed = jax.jit(lambda *args: mla_decompressed_prefill(*args, scale=0.07))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prefix", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    for prefix in args.prefix:
        inputs = case(args.heads, prefix, args.rows)
        keys = inputs[5].shape[1] * BLOCK
        pairs = args.rows * keys * args.heads
        flops = {
            "absorbed": 2 * args.heads * RANK * (NOPE + V) * args.rows + 2 * (2 * RANK + ROPE) * pairs,
            "decompressed": 2 * args.heads * RANK * (NOPE + V) * keys + 2 * (NOPE + ROPE + V) * pairs,
        }
        seconds = {
            name: time_call(lambda f=f: f(*inputs), args.iters)
            for name, f in (("absorbed", absorbed), ("decompressed", decompressed))
        }
        line = ", ".join(f"{name} {s * 1e3:.0f} ms ({flops[name] / 1e9:.1f} GFLOP)" for name, s in seconds.items())
        ratio = seconds["decompressed"] / seconds["absorbed"]
        print(f"{args.heads} heads, {args.rows} rows after {prefix}: {line}, ratio {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
