"""Paged attention for XLA:CPU as C++ kernels behind the XLA FFI (`cpu_attention.cc`).

Why: on XLA:CPU, paged attention in plain JAX (`paged_jax`) gathers each group's K/V pages
into a new buffer, then runs small batched matmuls and softmax passes one loop step at a
time, mostly on one thread: a decode spends about 0.25 ms per 8 rows x 128 keys, half a
batch-8 decode step, where its K/V bytes take a tenth of that at memory bandwidth; a prefill
chunk of 512 rows over a few hundred tokens of history spends ~40% of its step there. The
kernels read K/V rows in place from the cache pages and split their work over threads:
decode, each (sequence, kv head) reads its keys and values once for all its query heads;
prefill, tiles of 16 rows walk the keys 16 at a time with an online softmax, every product
a vector FMA.

They take an f32 cache (the CPU's) and a head_dim that is a multiple of 16 up to 256; for any
other cache dtype the `cpu` backend runs `paged_jax` instead. The source is compiled on first
use with the system C++ compiler (`$CXX`, else `c++`), for this machine's CPU, into
`$JAXSERVE_CACHE/cpu_kernels` (default `~/.cache/jaxserve`), keyed by a digest of the source,
the flags, the compiler and jaxlib: later processes load it.
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
import jax.numpy as jnp
import jaxlib
import numpy as np

from kernels_pallas import paged_jax

DECODE_TARGET, PREFILL_TARGET = "jaxserve_paged_decode", "jaxserve_paged_prefill"
SOURCE = Path(__file__).with_name("cpu_attention.cc")
# Vectorized float sums need reassociation; nothing here relies on signed zeros or traps.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast")


def compiler() -> str | None:
    """The C++ compiler the kernel is built with, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def available() -> bool:
    return compiler() is not None


def _library_path(cxx: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), cxx.encode(), jaxlib.__version__.encode()):
        digest.update(part)
    cache = Path(os.environ.get("JAXSERVE_CACHE", "~/.cache/jaxserve")).expanduser() / "cpu_kernels"
    return cache / f"cpu_attention-{digest.hexdigest()[:16]}.so"


@functools.cache
def register() -> None:
    """Build the kernel if this machine has no copy yet, then register it with XLA (once)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("the `cpu` attention backend compiles C++ kernels: no C++ compiler found "
                           "(set $CXX, or use --attention-backend jax)")
    path = _library_path(cxx)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # concurrent builds each rename theirs
            built = Path(tmp) / path.name
            cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building the CPU attention kernels failed ({' '.join(cmd)}):\n{done.stderr}")
            os.replace(built, path)
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(DECODE_TARGET, jax.ffi.pycapsule(library.JaxservePagedDecode), platform="cpu")
    jax.ffi.register_ffi_target(PREFILL_TARGET, jax.ffi.pycapsule(library.JaxservePagedPrefill), platform="cpu")


def _call(target: str, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
          int_args: tuple[jax.Array, ...], scale: float, soft_cap: float | None,
          sliding_window: int | None) -> jax.Array:
    """One kernel call: f32 in and out (q cast back to its dtype), `int_args` as int32."""
    if q.shape[-1] % 16 or q.shape[-1] > 256:
        raise ValueError(f"the cpu attention kernels need a head_dim that is a multiple of 16, at most 256, "
                         f"not {q.shape[-1]} (use --attention-backend jax)")
    register()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(()),
               *(a.astype(jnp.int32) for a in int_args), scale=np.float32(scale),
               soft_cap=np.float32(soft_cap or 0.0), window=np.int32(sliding_window or 0),
               num_threads=np.int32(len(os.sched_getaffinity(0))))
    return out.astype(q.dtype)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """q [B, H, D] -> [B, H, D]; sequence b attends to its first `lengths[b]` cached tokens
    (the contract of `reference.decode_attention`); q of another dtype is computed in f32."""
    if k_cache.dtype != jnp.float32:
        return paged_jax.decode_attention(q, k_cache, v_cache, layer, block_tables, lengths, scale=scale,
                                          soft_cap=soft_cap, sliding_window=sliding_window)
    return _call(DECODE_TARGET, q, k_cache, v_cache, layer, (block_tables, lengths), scale, soft_cap, sliding_window)


def prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """q [T, H, D] (ragged rows of S sequences) -> [T, H, D], causal over each sequence's
    history (the contract of `reference.prefill_attention`); zeros at rows past the last chunk."""
    if k_cache.dtype != jnp.float32:
        return paged_jax.prefill_attention(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start,
                                           scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    return _call(PREFILL_TARGET, q, k_cache, v_cache, layer, (block_tables, seq_lens, query_start), scale, soft_cap,
                 sliding_window)
