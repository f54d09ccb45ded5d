"""A one-file C++ measuring tool beside these benchmarks (`memory_bandwidth.cc`, `compute_peak.cc`),
built with the system C++ compiler for this CPU (`-march=native`) and run once."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from kernels_pallas import cpu_build


def build_and_run(source: Path, *args: object) -> list[str]:
    """The whitespace-separated fields `source`'s program prints when run with `args`."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / source.stem
        subprocess.run(
            [
                cpu_build.compiler() or "c++",
                "-O3",
                "-march=native",
                "-std=c++17",
                "-pthread",
                str(source),
                "-o",
                str(binary),
            ],
            check=True,
        )
        return subprocess.run([str(binary), *map(str, args)], check=True, capture_output=True, text=True).stdout.split()
