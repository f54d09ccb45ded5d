"""Attention backends by name: a pair of functions with the signatures of
`reference.decode_attention` and `reference.prefill_attention`.

`reference` is plain JAX (gather + masked softmax), kept simple: the oracle of the others.
`jax` is plain JAX that reads only what the sequences hold (`paged_jax.py`).
`cpu` is C++ decode and prefill kernels behind the XLA FFI (`cpu_attention.py`, built on first
use): the CPU default where a C++ compiler is found.
`pallas` is the Pallas kernels, the GPU default: the decode kernel measured faster on this GPU
generation (`gpu_select.py`: Triton's `decode.py` or Mosaic GPU's `decode_mosaic.py`) and the
Triton prefill kernel (`prefill.py`). `triton` and `mosaic` name one decode kernel each (with
the same prefill), for benchmarks and for overriding the pick.
The Pallas kernels run natively on GPU, and in interpret mode wherever JAX's default backend is
the CPU (slow; for tests), unless $JAXSERVE_PALLAS_INTERPRET says otherwise; Mosaic GPU's
interpreter needs jax >= 0.11.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from kernels_pallas import cpu_attention, cpu_build, decode, decode_mosaic, gpu_select, paged_jax, prefill, reference

BACKENDS = ("jax", "cpu", "reference", "pallas", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    decode: Callable
    prefill: Callable


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "reference":
        return AttentionBackend("reference", reference.decode_attention, reference.prefill_attention)
    if name == "jax":
        return AttentionBackend("jax", paged_jax.decode_attention, paged_jax.prefill_attention)
    if name == "cpu":
        return AttentionBackend("cpu", cpu_attention.decode_attention, cpu_attention.prefill_attention)
    if name == "pallas":
        return AttentionBackend("pallas", gpu_select.decode_attention, prefill.prefill_attention)
    if name == "triton":
        return AttentionBackend("triton", decode.decode_attention, prefill.prefill_attention)
    if name == "mosaic":
        return AttentionBackend("mosaic", decode_mosaic.decode_attention, prefill.prefill_attention)
    raise ValueError(f"unknown attention backend {name!r}; choose from: {', '.join(BACKENDS)}")


def default_attention_backend() -> str:
    """`pallas` where the kernels run natively (GPU); on CPU `cpu`, or `jax` when no C++
    compiler can build its kernel; `jax` elsewhere (TPU)."""
    platform = jax.default_backend()
    if platform == "gpu":
        return "pallas"
    return "cpu" if platform == "cpu" and cpu_build.available() else "jax"
