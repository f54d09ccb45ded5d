"""Builds and loads the C++ kernels for XLA:CPU (`cpu_attention.cc`, `cpu_matmul.cc`).

A source is compiled on first use with the system C++ compiler (`$CXX`, else `c++`), for this
machine's CPU, into `$JAXSERVE_CACHE/cpu_kernels` (default `~/.cache/jaxserve`), keyed by a
digest of the source, the headers beside it, the flags, the compiler, the instruction sets the
compiler enables for this CPU and jaxlib: later processes load it, and a cache shared with a
machine of another CPU builds its own copy.

`$JAXSERVE_CPU_KERNEL_FLAGS` adds compiler flags (split on spaces), e.g. `-mno-avx512bf16` to
build the kernels' paths for a CPU without AVX512-BF16 on one that has it (the tests do).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

# Vectorized float sums need reassociation; nothing here relies on signed zeros or traps.
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-ffp-contract=fast",
)


def compiler() -> str | None:
    """The C++ compiler the kernels are built with, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def available() -> bool:
    return compiler() is not None


def flags() -> tuple[str, ...]:
    """The compiler flags: FLAGS and those of `$JAXSERVE_CPU_KERNEL_FLAGS`."""
    return FLAGS + tuple(os.environ.get("JAXSERVE_CPU_KERNEL_FLAGS", "").split())


@functools.cache
def _target_macros(cxx: str, build_flags: tuple[str, ...]) -> bytes:
    """The compiler's predefined macros under `build_flags` (`-march=native`: __AVX512F__,
    __AVX512BF16__, ... for this CPU), so a library built for another CPU is not loaded here."""
    done = subprocess.run(
        [cxx, *(f for f in build_flags if f.startswith(("-m", "-f"))), "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
    )
    return done.stdout if done.returncode == 0 else b""


def _library_path(source: Path, cxx: str, build_flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what a source may include
    for part in (
        source.read_bytes(),
        *headers,
        " ".join(build_flags).encode(),
        cxx.encode(),
        _target_macros(cxx, build_flags),
        jaxlib.__version__.encode(),
    ):
        digest.update(part)
    cache = Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser() / "cpu_kernels"
    return cache / f"{source.stem}-{digest.hexdigest()[:16]}.so"


@functools.cache
def load(source: Path) -> ctypes.CDLL:
    """The library built from `source`, built first if this machine has no copy yet (once a process)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(
            f"the cpu kernels ({source.name}) are C++: no C++ compiler found (set $CXX, or use --attention-backend jax)"
        )
    build_flags = flags()
    path = _library_path(source, cxx, build_flags)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # concurrent builds each rename theirs
            built = Path(tmp) / path.name
            cmd = [cxx, *build_flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {source.name} failed ({' '.join(cmd)}):\n{done.stderr}")
            os.replace(built, path)
    return ctypes.cdll.LoadLibrary(str(path))


def register(source: Path, targets: dict[str, str]) -> None:
    """Loads `source`'s library and registers its handlers with XLA:CPU, as {target name:
    symbol}; registering again is a no-op."""
    _register(source, tuple(targets.items()))


@functools.cache
def _register(source: Path, targets: tuple[tuple[str, str], ...]) -> None:
    library = load(source)
    for name, symbol in targets:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
