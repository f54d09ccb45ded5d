"""Run an attention backend under a mesh: `jax.shard_map` over the kv-head axis.

Attention is independent per kv head, so with the query heads and the cache's kv heads
split over the tensor-parallel axis each device runs the unmodified kernel on its own heads:
no communication. The query heads of one kv head are contiguous ([H] = [KVH, group]), so a
contiguous split of H lines up with a contiguous split of KVH. Block tables, lengths and
the layer index are replicated; attention sinks [H] (an array option) are split with the
query heads.

`check_vma=False`: a `pallas_call` inside `shard_map` fails the varying-manual-axes check
("manual_axis_type ... must not be None") on the jax versions we run.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels_pallas.backends import AttentionBackend


def _shard_map(fn, mesh: Mesh, axis: str, in_specs: tuple, out_specs: P):
    """`jax.shard_map` of `fn` over `axis` of `mesh`; inside a shard_map already manual over other
    axes (a pipeline stage's, manual over "pp"), over `axis` of the context's mesh, the others left as they are."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.manual_axes:
        return jax.shard_map(
            fn, mesh=context, in_specs=in_specs, out_specs=out_specs, axis_names={axis}, check_vma=False
        )
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def shard_attention(backend: AttentionBackend, mesh: Mesh, axis: str = "tp") -> AttentionBackend:
    """Wrap a backend's functions so they take arrays sharded over `axis` on the head axes."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no {axis!r}")
    ways = mesh.shape[axis]
    heads = P(None, axis, None)  # q and the output: [N, H, D]
    cache = P(None, axis)  # [L, KVH, NB, BS, D]

    def check(q: jax.Array, k_cache: jax.Array) -> None:
        if k_cache.shape[1] % ways or q.shape[1] % ways:
            raise ValueError(f"{q.shape[1]} query heads / {k_cache.shape[1]} kv heads do not split {ways} ways")

    def run(kernel, q, k_cache, v_cache, *replicated, sinks=None, **options):
        """kernel(q, k_cache, v_cache, *replicated, sinks=..., **options) on each device's heads."""
        check(q, k_cache)
        specs = (heads, cache, cache, *(P() for _ in replicated))
        if sinks is None:
            fn = _shard_map(functools.partial(kernel, **options), mesh, axis, specs, heads)
            return fn(q, k_cache, v_cache, *replicated)
        with_sinks = lambda s, *args: kernel(*args, sinks=s, **options)  # noqa: E731
        fn = _shard_map(with_sinks, mesh, axis, (P(axis), *specs), heads)
        return fn(sinks, q, k_cache, v_cache, *replicated)

    def decode(q, k_cache, v_cache, layer, block_tables, lengths, **options):
        return run(backend.decode, q, k_cache, v_cache, layer, block_tables, lengths, **options)

    def prefill(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start, **options):
        return run(backend.prefill, q, k_cache, v_cache, layer, block_tables, seq_lens, query_start, **options)

    return AttentionBackend(f"{backend.name}[{axis}]", decode, prefill)
