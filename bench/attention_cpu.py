"""The CPU attention backends at the default model's shapes, per layer: `cpu` (cpu_attention's
C++ kernels, the CPU default) against `jax` (paged_jax) and the floors measured in the same run
(a plain f32 matmul for prefill, a copy for decode):

    python3 -m bench.attention_cpu            # SmolLM2-135M: 9 heads, 3 kv heads, head_dim 64
    python3 -m bench.attention_cpu --layers 30 --iters 3
    python3 -m bench.attention_cpu --kv-cache-dtypes float32 bfloat16 int8 fp8   # the cpu kernels per cache format
    python3 -m bench.attention_cpu --long-prompt   # f32 against bf16 queries (bf16 pairs) on a long prompt
    python3 -m bench.attention_cpu --decode-step   # a decode step's 30 layers, f32 against bf16 queries

Prefill cases are S sequences of `chunk` new tokens over `history` cached ones in a step of
S * chunk rows with block tables `width` pages wide (the step's bucket: wider than the
sequences need, as in serving). Useful FLOPs count QK^T and PV over each row's own causal
history; the figure of merit is their rate as a share of the matmul's. Decode cases report the
K/V bytes the sequences must read per call as a share of the copy bandwidth (read + write).
`x jax` is how many times faster than the `jax` backend the `cpu` one ran.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_bench import copy_bandwidth, scattered_tables, time_call
from kernels_pallas import cpu_attention, kv_quant, paged_jax

KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 3, 3, 64, 16
# (sequences, chunk, history, width in pages)
PREFILL = [(1, 512, 0, 32), (4, 128, 0, 32), (1, 512, 0, 128), (4, 128, 0, 128), (4, 128, 300, 64), (1, 512, 2048, 160)]
# (batch, context, width in pages)
DECODE = [(32, 200, 128), (64, 200, 16), (64, 700, 128), (64, 2048, 128), (1, 2048, 128)]


def _cache(rows: int, width: int, kv_dtype: str = "float32") -> tuple[jax.Array, jax.Array]:
    """K and V of `rows * width + 1` pages, stored as `--kv-cache-dtype kv_dtype` stores them."""
    shape = (1, KV_HEADS, rows * width + 1, BLOCK_SIZE, HEAD_DIM)
    k = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    store = jax.jit(functools.partial(kv_quant.quantize, dtype=kv_quant.storage_dtype(kv_dtype, jnp.float32, "cpu")))
    return store(k), store(k * 0.5)


def matmul_flops_per_s(iters: int) -> float:
    x, w = jnp.ones((512, 576), jnp.float32), jnp.ones((576, 1536), jnp.float32)
    dot = jax.jit(jnp.dot)
    return 2 * 512 * 576 * 1536 / time_call(lambda: dot(x, w), iters)


def bench_prefill(
    module,
    num_seqs: int,
    chunk: int,
    history: int,
    width: int,
    iters: int,
    kv_dtype: str = "float32",
    q_dtype: str = "float32",
) -> tuple[float, float]:
    """(seconds per layer of `module`'s prefill_attention, useful FLOPs)."""
    k, v = _cache(num_seqs, width, kv_dtype)
    tables = scattered_tables(np.random.default_rng(0), num_seqs, width)
    q = jax.random.normal(jax.random.key(1), (num_seqs * chunk, KV_HEADS * GROUP, HEAD_DIM)).astype(q_dtype)
    seq_lens = jnp.full((num_seqs,), history + chunk, jnp.int32)
    query_start = jnp.arange(num_seqs + 1, dtype=jnp.int32) * chunk
    fn = jax.jit(functools.partial(module.prefill_attention, scale=HEAD_DIM**-0.5))
    seconds = time_call(lambda: fn(q, k, v, jnp.int32(0), tables, seq_lens, query_start), iters)
    flops = 4 * num_seqs * chunk * (history + (chunk + 1) / 2) * KV_HEADS * GROUP * HEAD_DIM
    return seconds, flops


def bench_decode(
    module, batch: int, context: int, width: int, iters: int, kv_dtype: str = "float32"
) -> tuple[float, float]:
    """(seconds per layer of `module`'s decode_attention, K/V bytes the batch must read)."""
    k, v = _cache(batch, width, kv_dtype)
    tables = scattered_tables(np.random.default_rng(0), batch, width)
    q = jax.random.normal(jax.random.key(1), (batch, KV_HEADS * GROUP, HEAD_DIM))
    lengths = jnp.full((batch,), context, jnp.int32)
    fn = jax.jit(functools.partial(module.decode_attention, scale=HEAD_DIM**-0.5))
    seconds = time_call(lambda: fn(q, k, v, jnp.int32(0), tables, lengths), iters)
    return seconds, 2 * batch * context * KV_HEADS * k.shape[-1] * k.dtype.itemsize


def compare_formats(names: list[str], iters: int) -> None:
    """The cpu kernels' ms per layer on caches of each format, same run, and each one's time
    over the first format's (`x first`)."""
    head = " ".join(f"{n + ' ms':>12}" for n in names)
    ratios = " ".join(f"{'x ' + names[0][:6]:>9}" for _ in names[1:])
    print(f"{'cpu kernels: case':<40} {head} {ratios}")
    prefill = [("prefill {} x {} / {} / {}".format(*c), bench_prefill, c) for c in PREFILL]
    decode = [("decode {} / {} / {}".format(*c), bench_decode, c) for c in DECODE]
    cases = [(label, functools.partial(bench, cpu_attention, *c, iters)) for label, bench, c in prefill + decode]
    for label, run in cases:
        seconds = [run(kv_dtype=name)[0] for name in names]
        print(
            f"{label:<40} "
            + " ".join(f"{t * 1e3:12.3f}" for t in seconds)
            + " "
            + " ".join(f"{t / seconds[0]:9.2f}" for t in seconds[1:])
        )


# The prefill chunks of a 1,075-token prompt at --max-num-batched-tokens 512: (chunk, history).
LONG_PROMPT = [(512, 0), (512, 512), (51, 1024)]


def compare_query_dtypes(kv_dtypes: list[str], iters: int, layers: int) -> None:
    """A long prompt's prefill attention with f32 queries (an f32 model: f32 products) and bf16
    ones (a bf16 model: bf16 pairs where the CPU has AVX512-BF16), on caches of each format."""
    for kv_dtype in kv_dtypes:
        totals = {}
        for q_dtype in ("float32", "bfloat16"):
            runs = [
                bench_prefill(cpu_attention, 1, chunk, history, 80, iters, kv_dtype, q_dtype)
                for chunk, history in LONG_PROMPT
            ]
            totals[q_dtype] = sum(t for t, _ in runs)
            rate = sum(f for _, f in runs) / totals[q_dtype] / 1e9
            print(
                f"{kv_dtype} cache, {q_dtype} queries: {totals[q_dtype] * layers * 1e3:.0f} ms over {layers} layers "
                f"({rate:.0f} GFLOP/s)"
            )
        print(f"{kv_dtype} cache: bf16 queries take {totals['bfloat16'] / totals['float32']:.2f}x f32's time")


# A decode step's batches: (sequences, context).
DECODE_STEP = [(64, 256), (32, 256), (8, 1075), (1, 2048)]


def compare_decode_queries(kv_dtype: str, iters: int, layers: int) -> None:
    """A decode step's attention, all `layers` layers in one program, on a cache of that many layers
    (so K/V come from memory, as in serving, not from the caches of one layer's few MB), with f32
    queries (an f32 model's products) and bf16 ones (a bf16 model's: bf16 pairs on a bf16 cache
    where the CPU has AVX512-BF16), against the K/V bytes read per second."""
    print(
        f"{kv_dtype} cache, {layers} layers: {'batch x context':<16} {'f32 q ms':>9} {'GB/s':>6} "
        f"{'bf16 q ms':>9} {'GB/s':>6} {'bf16/f32':>8}"
    )
    for batch, context in DECODE_STEP:
        width = -(-context // BLOCK_SIZE)
        shape = (layers, KV_HEADS, batch * width + 1, BLOCK_SIZE, HEAD_DIM)
        store = kv_quant.storage_dtype(kv_dtype, jnp.float32, "cpu")
        k = jax.jit(lambda key: kv_quant.quantize(jax.random.normal(key, shape), store))(jax.random.key(0))
        v = jax.jit(lambda key: kv_quant.quantize(0.5 * jax.random.normal(key, shape), store))(jax.random.key(1))
        tables = scattered_tables(np.random.default_rng(0), batch, width)
        lengths = jnp.full((batch,), context, jnp.int32)

        def step(q, k, v, tables, lengths):
            layer = functools.partial(cpu_attention.decode_attention, scale=HEAD_DIM**-0.5)
            return jax.lax.fori_loop(0, layers, lambda i, q: layer(q, k, v, i, tables, lengths), q)

        step = jax.jit(step)
        q = jax.random.normal(jax.random.key(2), (batch, KV_HEADS * GROUP, HEAD_DIM))
        times = [
            time_call(functools.partial(step, q.astype(dtype), k, v, tables, lengths), iters, repeats=5)
            for dtype in (jnp.float32, jnp.bfloat16)
        ]
        nbytes = 2 * layers * batch * context * KV_HEADS * k.shape[-1] * k.dtype.itemsize
        print(
            f"{'':<{len(kv_dtype) + 18}}{f'{batch} x {context}':<16} "
            + " ".join(f"{t * 1e3:9.2f} {nbytes / t / 1e9:6.1f}" for t in times)
            + f" {times[1] / times[0]:8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="layers per step (the ms/step column)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=None,
        metavar="DTYPE",
        help="instead: the cpu kernels on caches of these formats (--kv-cache-dtype values)",
    )
    parser.add_argument(
        "--long-prompt",
        action="store_true",
        help="instead: a 1,075-token prompt's prefill chunks with f32 and bf16 queries, on caches "
        "of --kv-cache-dtypes (default float32 bfloat16)",
    )
    parser.add_argument(
        "--decode-step",
        action="store_true",
        help="instead: a decode step's attention over --layers layers of cache with f32 and bf16 "
        "queries, on caches of --kv-cache-dtypes (default bfloat16)",
    )
    args = parser.parse_args()
    if args.decode_step:
        for kv_dtype in args.kv_cache_dtypes or ["bfloat16"]:
            compare_decode_queries(kv_dtype, args.iters, args.layers)
        return
    if args.long_prompt:
        compare_query_dtypes(args.kv_cache_dtypes or ["float32", "bfloat16"], args.iters, args.layers)
        return
    if args.kv_cache_dtypes:
        compare_formats(args.kv_cache_dtypes, args.iters)
        return
    against_jax(args.iters, args.layers)


def against_jax(iters: int, layers: int) -> None:
    """The cpu kernels against the jax backend's attention, prefill and decode cases, with the
    share of the matmul peak (prefill) and of the copy bandwidth (decode) each reaches."""
    peak = matmul_flops_per_s(iters)
    copy_bps = copy_bandwidth(1 << 24, jnp.float32, iters)  # 64 MB would time page faults
    print(f"f32 matmul 512x576x1536: {peak / 1e9:.0f} GFLOP/s; copy: {copy_bps / 1e9:.1f} GB/s")
    print(
        f"{'prefill S x chunk / history / width':<38} {'ms/layer':>9} {'ms/step':>8} {'GFLOP/s':>8} "
        f"{'%matmul':>8} {'jax ms':>8} {'x jax':>6}"
    )
    for case in PREFILL:
        seconds, flops = bench_prefill(cpu_attention, *case, iters)
        jax_seconds, _ = bench_prefill(paged_jax, *case, iters)
        label = f"{case[0]} x {case[1]} / {case[2]} / {case[3]}"
        print(
            f"{label:<38} {seconds * 1e3:9.2f} {seconds * layers * 1e3:8.0f} "
            f"{flops / seconds / 1e9:8.1f} {100 * flops / seconds / peak:8.1f} "
            f"{jax_seconds * 1e3:8.2f} {jax_seconds / seconds:6.1f}"
        )
    print(
        f"{'decode batch / context / width':<38} {'ms/layer':>9} {'ms/step':>8} {'GB/s':>8} {'%copy':>8} "
        f"{'jax ms':>8} {'x jax':>6}"
    )
    for case in DECODE:
        seconds, nbytes = bench_decode(cpu_attention, *case, iters)
        jax_seconds, _ = bench_decode(paged_jax, *case, iters)
        print(
            f"{'{} / {} / {}'.format(*case):<38} {seconds * 1e3:9.2f} {seconds * layers * 1e3:8.0f} "
            f"{nbytes / seconds / 1e9:8.1f} {100 * nbytes / seconds / copy_bps:8.1f} "
            f"{jax_seconds * 1e3:8.2f} {jax_seconds / seconds:6.1f}"
        )


if __name__ == "__main__":
    main()
