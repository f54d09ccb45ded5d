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
import subprocess
import tempfile
from pathlib import Path

from kernels_pallas import cpu_build

SOURCE = Path(__file__).with_name("compute_peak.cc")


def measure(threads: int, reps: int, iters: int = 40_000_000) -> tuple[float, float]:
    """(f32, bf16) FLOP per second over `threads` threads."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "compute_peak"
        subprocess.run([cpu_build.compiler() or "c++", "-O3", "-march=native", "-std=c++17", "-pthread", str(SOURCE),
                        "-o", str(binary)], check=True)
        out = subprocess.run([str(binary), str(threads), str(iters), str(reps)], check=True, capture_output=True,
                             text=True).stdout.split()
    return float(out[0]), float(out[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    f32, bf16 = measure(args.threads, args.reps)
    print(f"{args.threads} threads: f32 FMA {f32 / 1e9:.0f} GFLOP/s, "
          + (f"bf16 dot products {bf16 / 1e9:.0f} GFLOP/s" if bf16 else "no AVX512-BF16"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
