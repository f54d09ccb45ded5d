"""Kernel benchmark: Pallas paged attention vs the pure-JAX reference vs JAX's shipped kernel.

    python3 -m bench.kernel_bench            # the GPU grid (batch 1-256, context 128-32k, ...)
    python3 -m bench.kernel_bench --quick    # a tiny grid; on CPU the kernels run interpreted

Decode cases report the K/V bytes a sequence must read (its touched pages, K and V) divided by
the time per call, next to the bandwidth of a device-to-device copy measured in the same run
(read + write bytes / time): the fraction of the copy bandwidth is the figure of merit, since
decode attention is memory-bound (see kernels_pallas/decode.py for the floor). They also time
`jax.experimental.pallas.ops.gpu.paged_attention` (one layer, q pre-scaled) on the same
inputs. Prefill cases report achieved TFLOP/s against the reference and as a share of an
n x n x n matmul measured in the same run. Absolute times mean
something only on a GPU; on CPU the interpreted kernels are slow by design.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernel_report import ms, print_tables
from kernels_pallas import common, decode, prefill, reference

# Largest accepted difference between a kernel and the reference, by dtype (outputs are
# averages of unit-normal values, so of order 1).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    group: int  # query heads per kv head
    block_size: int
    num_kv_heads: int = 8
    head_dim: int = 128

    def label(self) -> str:
        return f"b{self.batch} ctx{self.context} g{self.group} bs{self.block_size}"


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    num_seqs: int
    chunk: int
    history: int
    group: int
    block_size: int
    num_kv_heads: int = 8
    head_dim: int = 128

    def label(self) -> str:
        return f"s{self.num_seqs} chunk{self.chunk} hist{self.history} g{self.group} bs{self.block_size}"


def gpu_decode_grid() -> list[DecodeCase]:
    """Batch x context at GQA 4 / block 16, then GQA ratios and block sizes at one mid point.
    Batch x context is capped at 2M tokens (~8.6 GB of bf16 K/V at 8 x 128, plus the
    reference's gathered copy)."""
    cases = [DecodeCase(b, c, 4, 16) for b in (1, 8, 64, 256) for c in (128, 2048, 32768) if b * c <= 2**21]
    cases += [DecodeCase(64, 4096, g, 16) for g in (1, 8)]
    cases += [DecodeCase(64, 4096, 4, bs) for bs in (8, 32)]
    return cases


def quick_decode_grid() -> list[DecodeCase]:
    return [DecodeCase(b, c, g, 16, num_kv_heads=2, head_dim=64) for b, c, g in ((1, 128, 4), (4, 256, 4), (4, 256, 1))]


def gpu_prefill_grid() -> list[PrefillCase]:
    return [PrefillCase(4, 512, 0, 4, 16), PrefillCase(4, 512, 4096, 4, 16), PrefillCase(16, 128, 2048, 8, 16)]


def quick_prefill_grid() -> list[PrefillCase]:
    return [PrefillCase(2, 16, 24, 4, 16, num_kv_heads=2, head_dim=64)]


def time_call(fn: Callable[[], jax.Array], iters: int, repeats: int = 3) -> float:
    """Seconds per call: best of `repeats` means over `iters` back-to-back calls (compiled first)."""
    jax.block_until_ready(fn())
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def copy_bandwidth(nbytes: int, dtype, iters: int) -> float:
    """Bytes/s of a device-to-device elementwise copy (x + 1): read + write, as HBM sees it."""
    x = jnp.zeros((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    copy = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / time_call(lambda: copy(x), max(iters, 10), repeats=5)


def matmul_peak(n: int, dtype, iters: int) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (f32 accumulation): the compute ceiling that
    prefill is held against."""
    a, b = (random_normal(seed, (n, n), jnp.dtype(dtype)) for seed in (2, 3))
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2 * n**3 / time_call(lambda: matmul(a, b), iters, repeats=5)


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_normal(seed, shape: tuple[int, ...], dtype) -> jax.Array:
    """Standard-normal values drawn on device in one fused program. The key is XLA's own bit
    generator (`unsafe_rbg`): threefry's counters would take ~16 bytes per element of scratch,
    past the memory of a GPU for the largest pools."""
    return jax.random.normal(jax.random.key(seed, impl="unsafe_rbg"), shape, jnp.float32).astype(dtype)


def _pool(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int, dtype):
    """One layer of K and V in the shipped op's layout [KVH, NB, BS, D], random on device."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return random_normal(0, shape, jnp.dtype(dtype)), random_normal(1, shape, jnp.dtype(dtype))


def scattered_tables(rng, rows: int, width: int) -> jax.Array:
    """Distinct blocks 1..rows*width in random order (block 0 stays reserved)."""
    return jnp.asarray(rng.permutation(np.arange(1, rows * width + 1)).reshape(rows, width), jnp.int32)


def shipped_k_splits(width: int) -> int:
    """The shipped op's defaults (16 splits of >= 8 pages) where the table allows: the split
    count must divide the table width, so take the largest power of two <= 16 that does and
    leaves each split its 8 pages per step, else fewer splits."""
    splits = 16
    while splits > 1 and (width % splits or width // splits < 8):
        splits //= 2
    return splits


def _time_variants(row: dict, variants: dict[str, Callable], args: tuple, iters: int) -> None:
    """Time each variant into row[name_s] and its max abs difference from the reference into
    row[name_err]; a variant that fails here (unsupported shape, out of memory) is reported
    as row[name_error] instead of ending the run."""
    want = None
    for name, fn in variants.items():
        try:
            out = fn(*args)
            if name == "reference":
                want = out
            row[f"{name}_s"] = time_call(lambda: fn(*args), iters)
            row[f"{name}_out"] = out
        except Exception as e:
            row[f"{name}_s"] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
    for name in variants:
        out = row.pop(f"{name}_out", None)
        if out is not None and want is not None:
            diff = jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))
            row[f"{name}_err"] = float(jnp.max(diff))


def bench_decode(
    case: DecodeCase, dtype, interpret: bool, iters: int, copy_bps: float, with_reference: bool = True
) -> dict:
    """One decode case: ours, JAX's shipped op and (unless `with_reference` is off, for cases
    whose gathered copy of the pool would not fit) the reference, on the same inputs."""
    rng = np.random.default_rng(0)
    width = common.cdiv(case.context, case.block_size)
    k, v = _pool(case.num_kv_heads, case.batch * width + 1, case.block_size, case.head_dim, dtype)
    num_heads = case.num_kv_heads * case.group
    q = random_normal(2, (case.batch, num_heads, case.head_dim), jnp.dtype(dtype))
    tables = scattered_tables(rng, case.batch, width)
    lengths = jnp.full((case.batch,), case.context, jnp.int32)
    scale = case.head_dim**-0.5
    layer = jnp.int32(0)

    # k[None]: the stacked [1, KVH, NB, BS, D] view inside jit is a bitcast, not a copy.
    ours = jax.jit(
        lambda q, k, v, t, n: decode.decode_attention(
            q, k[None], v[None], layer, t, n, scale=scale, interpret=interpret
        )
    )
    ref = jax.jit(lambda q, k, v, t, n: reference.decode_attention(q, k[None], v[None], layer, t, n, scale=scale))
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    splits = shipped_k_splits(width)
    shipped = jax.jit(
        lambda q, k, v, t, n: paged_attention(
            (q.astype(jnp.float32) * scale).astype(q.dtype),
            k,
            v,
            t,
            n,
            pages_per_compute_block=min(8, width // splits),
            k_splits=splits,
            interpret=interpret,
        )
    )

    args = (q, k, v, tables, lengths)
    row = {"kind": "decode", "case": case.label(), **dataclasses.asdict(case), "jax_k_splits": splits}
    touched = case.batch * width * case.block_size
    row["kv_bytes"] = 2 * touched * case.num_kv_heads * case.head_dim * jnp.dtype(dtype).itemsize
    variants = {"ours": ours, "reference": ref, "shipped": shipped}
    if not with_reference:
        del variants["reference"]
    _time_variants(row, variants, args, iters)
    if row["ours_s"]:
        row["ours_gbps"] = row["kv_bytes"] / row["ours_s"] / 1e9
        row["ours_pct_copy"] = 100 * row["kv_bytes"] / row["ours_s"] / copy_bps
        if row.get("shipped_s"):
            row["speedup_vs_shipped"] = row["shipped_s"] / row["ours_s"]
        if row.get("reference_s"):
            row["speedup_vs_reference"] = row["reference_s"] / row["ours_s"]
    del k, v
    return row


def bench_prefill(case: PrefillCase, dtype, interpret: bool, iters: int) -> dict:
    rng = np.random.default_rng(0)
    total = case.history + case.chunk
    width = common.cdiv(total, case.block_size)
    k, v = _pool(case.num_kv_heads, case.num_seqs * width + 1, case.block_size, case.head_dim, dtype)
    num_heads = case.num_kv_heads * case.group
    tokens = case.num_seqs * case.chunk
    q = random_normal(2, (tokens, num_heads, case.head_dim), jnp.dtype(dtype))
    tables = scattered_tables(rng, case.num_seqs, width)
    seq_lens = jnp.full((case.num_seqs,), total, jnp.int32)
    query_start = jnp.arange(case.num_seqs + 1, dtype=jnp.int32) * case.chunk
    scale = case.head_dim**-0.5
    layer = jnp.int32(0)
    ours = jax.jit(
        lambda q, k, v, t, n, s: prefill.prefill_attention(
            q, k[None], v[None], layer, t, n, s, scale=scale, interpret=interpret
        )
    )
    ref = jax.jit(
        lambda q, k, v, t, n, s: reference.prefill_attention(q, k[None], v[None], layer, t, n, s, scale=scale)
    )
    args = (q, k, v, tables, seq_lens, query_start)
    # QK^T and PV over the history plus the causal half of the chunk.
    keys_per_row = case.history + (case.chunk + 1) / 2
    flops = 4 * tokens * keys_per_row * num_heads * case.head_dim
    row = {"kind": "prefill", "case": case.label(), **dataclasses.asdict(case), "flops": flops}
    _time_variants(row, {"ours": ours, "reference": ref}, args, iters)
    for name in ("ours", "reference"):
        if row[f"{name}_s"]:
            row[f"{name}_tflops"] = flops / row[f"{name}_s"] / 1e12
    if row["ours_s"] and row["reference_s"]:
        row["speedup_vs_reference"] = row["reference_s"] / row["ours_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    interpret = common.resolve_interpret(None)
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    iters = args.iters or (2 if on_cpu else 20)
    quick = args.quick or on_cpu
    decode_cases = quick_decode_grid() if quick else gpu_decode_grid()
    prefill_cases = [] if args.no_prefill else (quick_prefill_grid() if quick else gpu_prefill_grid())
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"dtype {dtype.name}, pallas {'interpreted' if interpret else 'native'}, {iters} iters"
    )

    # CPU: 16 MiB (bigger fresh outputs pay page faults every call); GPU: 1 GiB, past any cache.
    copy_bps = copy_bandwidth((16 if on_cpu else 1024) * 2**20, dtype, iters)
    matmul_flops = matmul_peak(256 if on_cpu else 8192, dtype, iters) if prefill_cases else None
    header = {
        "copy_bps": copy_bps,
        "matmul_flops": matmul_flops,
        "device": jax.devices()[0].device_kind,
        "interpret": interpret,
        "dtype": dtype.name,
    }
    rows = _run_cases(decode_cases, prefill_cases, dtype, interpret, iters, copy_bps, args.json, header)
    return _report(rows, copy_bps, matmul_flops, dtype)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid (CPU, or a smoke run)")
    parser.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    parser.add_argument("--iters", type=int, default=None, help="calls per timing (default 20 GPU, 2 CPU)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--no-prefill", action="store_true")
    return parser.parse_args(argv)


def _run_cases(
    decode_cases: list[DecodeCase],
    prefill_cases: list[PrefillCase],
    dtype,
    interpret: bool,
    iters: int,
    copy_bps: float,
    json_path: str | None,
    header: dict,
) -> list[dict]:
    """Every case's row, each printed as it is measured."""
    rows: list[dict] = []
    for case in decode_cases:
        rows.append(bench_decode(case, dtype, interpret, iters, copy_bps))
        _save_json(json_path, header, rows)
        r = rows[-1]
        print(
            f"  {r['case']}: ours {ms(r['ours_s'])} ms, ref {ms(r.get('reference_s'))} ms, "
            f"jax {ms(r.get('shipped_s'))} ms",
            flush=True,
        )
    for pcase in prefill_cases:
        rows.append(bench_prefill(pcase, dtype, interpret, iters))
        _save_json(json_path, header, rows)
        print(f"  {rows[-1]['case']}: ours {ms(rows[-1]['ours_s'])} ms", flush=True)
    return rows


def _save_json(path: str | None, header: dict, rows: list[dict]) -> None:
    """`header` and the rows so far at `path`, if any: rewritten after every case, so a run cut short
    still leaves its rows."""
    if path:
        with open(path, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1)


def _report(rows: list[dict], copy_bps: float, matmul_flops: float | None, dtype) -> int:
    """Print the tables and the median decode bandwidth; 1 when a case failed or mismatched the reference."""
    print()
    print_tables(rows, copy_bps, matmul_flops)
    errors = [r for r in rows if "ours_error" in r or r.get("ours_err", 0) > TOLERANCE[dtype.name]]
    pct = [r["ours_pct_copy"] for r in rows if "ours_pct_copy" in r]
    if pct:
        print(f"median decode bandwidth: {statistics.median(pct):.1f}% of copy")
    if errors:
        print(f"FAILED or MISMATCHED vs reference in {len(errors)} case(s): " + ", ".join(r["case"] for r in errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
