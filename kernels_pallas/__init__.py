"""Tensor layer: paged-attention kernels (Pallas) and their pure-JAX references.

An attention backend is a pair of functions with the signatures of
`reference.decode_attention` and `reference.prefill_attention`: `paged_jax` (plain JAX),
`cpu_attention` (C++ kernels behind the XLA FFI, the CPU default; `cpu_matmul` holds the
model's matmuls beside them, its scanned layers' on weights in panels and the tied head's;
`cpu_build` builds both), `decode` (Pallas Triton) and `decode_mosaic` (Pallas Mosaic GPU,
Hopper), one of which `gpu_select` picks per GPU generation, and `prefill` (Pallas Triton):
the GPU default; `reference` (their oracle). Every backend reads
every cache format of `kv_quant` (`--kv-cache-dtype`). The model looks one up by
name with `get_attention_backend` (`default_attention_backend()` names the one for this
machine) and, under a mesh, wraps it with `shard_attention`.
"""

from __future__ import annotations

from kernels_pallas import (
    common,
    cpu_attention,
    cpu_build,
    cpu_matmul,
    decode,
    decode_mosaic,
    gpu_select,
    kv_quant,
    paged_jax,
    prefill,
    reference,
)
from kernels_pallas.backends import (
    BACKENDS,
    AttentionBackend,
    default_attention_backend,
    get_attention_backend,
)
from kernels_pallas.sharded import shard_attention

__all__ = [
    "common",
    "cpu_attention",
    "cpu_build",
    "cpu_matmul",
    "decode",
    "decode_mosaic",
    "gpu_select",
    "kv_quant",
    "paged_jax",
    "prefill",
    "reference",
    "BACKENDS",
    "AttentionBackend",
    "default_attention_backend",
    "get_attention_backend",
    "shard_attention",
]
