"""Attention backends of multi-head latent attention (MLA): the `AttentionBackend` pair an MLA
model runs (its layers' attention reads the latent cache in the absorbed form:
`mla_reference`'s signatures), by the name of the attention backend the engine was given.

Every backend name maps to an MLA pair: the GPU backends' decode is the Pallas kernel
(`mla_decode`), the rest runs the pure-JAX absorbed form (`mla_reference`: on CPU too, where no
C++ MLA kernel exists yet; its prefill scores every row against every sequence of the step). A
prefill step of many rows does not call the backend's prefill: the model decompresses instead
(`mla_decompressed`, chosen by `jaxserve.model.latent_attention.decompresses`).
Under a mesh, `shard_latent_attention` splits the query heads over the tensor-parallel axis and
reads the latent cache replicated (it has no heads to split).
"""

from __future__ import annotations

import functools

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels_pallas import mla_decode, mla_reference
from kernels_pallas.backends import BACKENDS, AttentionBackend
from kernels_pallas.sharded import _shard_map


def get_mla_backend(name: str) -> AttentionBackend:
    """The MLA attention of backend `name` (one of `BACKENDS`): the Pallas (Triton) decode kernel
    for the GPU backends (`pallas`, `triton`, `mosaic`), the pure-JAX one for the others; prefill
    is pure JAX everywhere."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from: {', '.join(BACKENDS)}")
    gpu = name in ("pallas", "triton", "mosaic")
    decode = mla_decode.mla_decode_attention if gpu else mla_reference.mla_decode_attention
    return AttentionBackend(f"mla-{name}", decode, mla_reference.mla_prefill_attention)


def shard_latent_attention(backend: AttentionBackend, mesh: Mesh, axis: str = "tp") -> AttentionBackend:
    """The MLA backend's functions under `jax.shard_map`: query heads (and the output) split over
    `axis`, the latent cache, block tables and lengths replicated."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {axis!r}")
    ways = mesh.shape[axis]
    heads = P(None, axis, None)

    def check(q) -> None:
        if q.shape[1] % ways:
            raise ValueError(f"{q.shape[1]} query heads do not split {ways} ways")

    def decode(q, k_cache, v_cache, layer, block_tables, lengths, **options):
        check(q)
        fn = functools.partial(backend.decode, **options)
        return _shard_map(fn, mesh, axis, (heads, P(), P(), P(), P(), P()), heads)(
            q, k_cache, v_cache, layer, block_tables, lengths
        )

    def prefill(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start, **options):
        check(q)
        fn = functools.partial(backend.prefill, **options)
        return _shard_map(fn, mesh, axis, (heads, P(), P(), P(), P(), P(), P()), heads)(
            q, k_cache, v_cache, layer, block_tables, seq_lens, query_start
        )

    return AttentionBackend(f"{backend.name}[{axis}]", decode, prefill)
