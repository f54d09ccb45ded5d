"""Run in a subprocess by test_kernel_sharded.py, with 4 simulated CPU devices.

Exits non-zero (an AssertionError) unless every backend, wrapped by `shard_attention` and fed
head-sharded arrays, matches the unsharded reference and returns head-sharded output; and with
attention sinks (an [H] option the wrapper splits with the heads), the `jax` backend too.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from paged_cases import (  # noqa: E402
    LAYER,
    SCALE,
    TOLERANCE,
    assert_close,
    block_tables,
    decode_lengths,
    make_cache,
    prefill_sequences,
    queries,
    reference_decode,
    reference_prefill,
)

from kernels_pallas import get_attention_backend, shard_attention  # noqa: E402

NUM_KV_HEADS, GROUP, BLOCK, WIDTH = 4, 2, 8, 4


def main(dp: int, tp: int) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(dp, tp), ("dp", "tp"))
    rng = np.random.default_rng(0)
    cache = make_cache(rng, NUM_KV_HEADS, BLOCK, 24, jnp.float32)
    k = jax.device_put(cache.k, NamedSharding(mesh, P(None, "tp")))
    v = jax.device_put(cache.v, NamedSharding(mesh, P(None, "tp")))
    heads = NamedSharding(mesh, P(None, "tp", None))
    layer = jnp.int32(LAYER)

    lengths = decode_lengths(rng, BLOCK, WIDTH)
    tables = block_tables(rng, lengths, WIDTH, cache.num_blocks)
    q = queries(rng, len(lengths), NUM_KV_HEADS * GROUP, jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    want_decode = reference_decode(q, cache.k, cache.v, layer, tables, lengths, scale=SCALE)

    seqs = prefill_sequences(rng, BLOCK, WIDTH)
    seq_lens = jnp.asarray([h + c for h, c in seqs], jnp.int32)
    ptables = block_tables(rng, [h + c for h, c in seqs], WIDTH, cache.num_blocks)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum([c for _, c in seqs])]), jnp.int32)
    pq = queries(rng, int(query_start[-1]) + 2, NUM_KV_HEADS * GROUP, jnp.float32)
    want_prefill = reference_prefill(pq, cache.k, cache.v, layer, ptables, seq_lens, query_start, scale=SCALE)

    for name in ("reference", "pallas"):
        backend = shard_attention(get_attention_backend(name), mesh, "tp")
        decode = jax.jit(lambda *a: backend.decode(*a, scale=SCALE))
        got = decode(jax.device_put(q, heads), k, v, layer, tables, lengths)
        assert got.sharding.spec == P(None, "tp", None), got.sharding
        assert_close(got, want_decode, TOLERANCE[jnp.float32])
        prefill = jax.jit(lambda *a: backend.prefill(*a, scale=SCALE))
        got = prefill(jax.device_put(pq, heads), k, v, layer, ptables, seq_lens, query_start)
        assert_close(got, want_prefill, TOLERANCE[jnp.float32])
        print(f"{name} on a {dp}x{tp} mesh: ok")

    sinks = jnp.asarray(rng.normal(0.0, 2.0, NUM_KV_HEADS * GROUP), jnp.float32)
    backend = shard_attention(get_attention_backend("jax"), mesh, "tp")
    got = jax.jit(lambda *a: backend.decode(*a[:-1], scale=SCALE, sinks=a[-1]))(
        jax.device_put(q, heads), k, v, layer, tables, lengths, sinks
    )
    assert_close(got, reference_decode(q, cache.k, cache.v, layer, tables, lengths, scale=SCALE, sinks=sinks), 1e-5)
    got = jax.jit(lambda *a: backend.prefill(*a[:-1], scale=SCALE, sinks=a[-1]))(
        jax.device_put(pq, heads), k, v, layer, ptables, seq_lens, query_start, sinks
    )
    want = reference_prefill(pq, cache.k, cache.v, layer, ptables, seq_lens, query_start, scale=SCALE, sinks=sinks)
    assert_close(got, want, 1e-5)
    print(f"jax with sinks on a {dp}x{tp} mesh: ok")


if __name__ == "__main__":
    for mesh_shape in sys.argv[1:]:  # "DPxTP"
        main(*map(int, mesh_shape.split("x")))
