"""This machine's memory bandwidth, for the weight-bandwidth floor of a decode step (weight bytes
per step / read bandwidth: docs/performance.md, "Quantized weights"):

    python3 -m bench.memory_bandwidth [--threads 2] [--mib 1024] [--reps 5]

Builds `memory_bandwidth.cc` with the system C++ compiler and runs it: threads streaming a buffer
much larger than the caches, reading it (a sum, as a matmul streams its weights) and copying it
(read + write). Prints the best of the repetitions in GB/s.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.native_tool import build_and_run

SOURCE = Path(__file__).with_name("memory_bandwidth.cc")


def measure(threads: int, mib: int, reps: int) -> tuple[float, float]:
    """(read, copy) bytes per second; copy counts the bytes read and written."""
    out = build_and_run(SOURCE, threads, mib, reps)
    return float(out[0]), float(out[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    read, copy = measure(args.threads, args.mib, args.reps)
    print(
        f"{args.threads} threads, {args.mib} MiB: read {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s (read + write)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
