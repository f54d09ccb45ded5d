"""Tables of kernel benchmark rows (bench/kernel_bench.py's dicts); plain Python, no JAX, so that
a process that must not touch the device (bench.gpu_check's supervisor) can print them too."""

from __future__ import annotations

import math
import sys


def ms(x: float | None) -> str:
    return f"{'n/a':>8}" if x is None else f"{1e3 * x:8.3f}"


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'n/a':>{width}}" if x is None or math.isnan(x) else f"{x:{width}.{digits}f}"


def _err(x: float | None) -> str:
    return f"{'n/a':>8}" if x is None else f"{x:8.1e}"


def print_decode_table(rows: list[dict], copy_bps: float, out=sys.stdout) -> None:
    """Decode rows: time, K/V GB/s and % of the copy bandwidth, JAX's shipped kernel and the
    reference (ms and our speedup over each), and `err`, our largest absolute difference from
    the reference (n/a: not run)."""
    print(f"copy bandwidth (read + write): {copy_bps / 1e9:.1f} GB/s", file=out)
    print(
        f"{'decode case':<28} {'KV MB':>8} {'ours ms':>8} {'GB/s':>8} {'%copy':>6} "
        f"{'jax ms':>8} {'x jax':>6} {'ref ms':>8} {'x ref':>6} {'err':>8}",
        file=out,
    )
    for r in rows:
        print(
            f"{r['case']:<28} {r['kv_bytes'] / 1e6:8.1f} {ms(r['ours_s'])} "
            f"{_num(r.get('ours_gbps'), 8, 1)} {_num(r.get('ours_pct_copy'), 6, 1)} "
            f"{ms(r.get('shipped_s'))} {_num(r.get('speedup_vs_shipped'), 6, 2)} "
            f"{ms(r.get('reference_s'))} {_num(r.get('speedup_vs_reference'), 6, 2)} "
            f"{_err(r.get('ours_err'))}",
            file=out,
        )
        _print_errors(r, ("ours", "reference", "shipped"), out)


def print_prefill_table(rows: list[dict], matmul_flops: float | None, out=sys.stdout) -> None:
    """Prefill rows: time, TFLOP/s and % of `matmul_flops`, the reference, and `err`."""
    if matmul_flops:
        print(f"matmul peak: {matmul_flops / 1e12:.1f} TFLOP/s", file=out)
    print(
        f"{'prefill case':<36} {'ours ms':>8} {'TFLOP/s':>8} {'%peak':>6} {'ref ms':>8} {'x ref':>6} {'err':>8}",
        file=out,
    )
    for r in rows:
        tflops = r.get("ours_tflops")
        peak = 100 * tflops * 1e12 / matmul_flops if matmul_flops and tflops else None
        print(
            f"{r['case']:<36} {ms(r['ours_s'])} {_num(tflops, 8, 2)} {_num(peak, 6, 1)} "
            f"{ms(r.get('reference_s'))} {_num(r.get('speedup_vs_reference'), 6, 2)} "
            f"{_err(r.get('ours_err'))}",
            file=out,
        )
        _print_errors(r, ("ours", "reference"), out)


def _print_errors(row: dict, variants: tuple[str, ...], out) -> None:
    for name in variants:
        if f"{name}_error" in row:
            print(f"    {name}_error: {row[f'{name}_error']}", file=out)


def print_tables(rows: list[dict], copy_bps: float, matmul_flops: float | None = None, out=sys.stdout) -> None:
    print_decode_table([r for r in rows if r["kind"] == "decode"], copy_bps, out)
    prefill_rows = [r for r in rows if r["kind"] == "prefill"]
    if prefill_rows:
        print_prefill_table(prefill_rows, matmul_flops, out)
