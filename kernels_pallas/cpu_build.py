"""Builds and loads the C++ kernels for XLA:CPU (`cpu_attention.cc`, `cpu_matmul.cc`).

A source is compiled on first use with the system C++ compiler (`$CXX`, else `c++`), for this
machine's CPU, into `$JAXSERVE_CACHE/cpu_kernels` (default `~/.cache/jaxserve`), keyed by a
digest of the source, the headers beside it, the flags, the compiler and jaxlib: later processes
load it.
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
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast")


def compiler() -> str | None:
    """The C++ compiler the kernels are built with, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def available() -> bool:
    return compiler() is not None


def _library_path(source: Path, cxx: str) -> Path:
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what a source may include
    for part in (source.read_bytes(), *headers, " ".join(FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode()):
        digest.update(part)
    cache = Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser() / "cpu_kernels"
    return cache / f"{source.stem}-{digest.hexdigest()[:16]}.so"


@functools.cache
def load(source: Path) -> ctypes.CDLL:
    """The library built from `source`, built first if this machine has no copy yet (once a process)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(f"the cpu kernels ({source.name}) are C++: no C++ compiler found "
                           "(set $CXX, or use --attention-backend jax)")
    path = _library_path(source, cxx)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # concurrent builds each rename theirs
            built = Path(tmp) / path.name
            cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)]
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
