"""This machine's arithmetic peak, for the compute floor of a prefill (FLOPs / peak FLOP/s:
docs/performance.md, "Prefill against the matrix peak"):

    python3 -m bench.compute_peak [--threads 2] [--reps 5]

Builds `compute_peak.cc` with the system C++ compiler (`-march=native`) and runs it: threads of
register-only 512-bit multiply-adds, f32 FMAs and AVX512-BF16 dot products (the instructions the
C++ matmul and attention kernels use). Prints the best of the repetitions in GFLOP/s. Needs an
AVX-512 CPU; bf16 prints 0 without AVX512-BF16 (this VM: no AMX, so that is its bf16 matrix peak).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.native_tool import build_and_run

SOURCE = Path(__file__).with_name("compute_peak.cc")


def measure(threads: int, reps: int, iters: int = 40_000_000) -> tuple[float, float]:
    """(f32, bf16) FLOP per second over `threads` threads."""
    out = build_and_run(SOURCE, threads, iters, reps)
    return float(out[0]), float(out[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    f32, bf16 = measure(args.threads, args.reps)
    print(
        f"{args.threads} threads: f32 FMA {f32 / 1e9:.0f} GFLOP/s, "
        + (f"bf16 dot products {bf16 / 1e9:.0f} GFLOP/s" if bf16 else "no AVX512-BF16")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
