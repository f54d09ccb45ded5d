"""The MLA decode kernel (Pallas, interpret mode) equals the pure-JAX absorbed-form reference on
paged latent caches: ragged lengths, padding rows of length 0, several head blocks, the
flash-decoding split, bf16; and the reference equals attention over the decompressed keys and
values (the absorbed form's identity)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import mla_decode, mla_reference

LAYERS, BLOCKS, BLOCK = 2, 24, 8


def latent_cache(rng, latent_dim: int, rope_dim: int, dtype):
    rows = rng.standard_normal((LAYERS, 1, BLOCKS, BLOCK, latent_dim + rope_dim)).astype(np.float32)
    k, v = mla_reference.split_latent(jnp.asarray(rows), latent_dim)
    return k.astype(dtype), v.astype(dtype)


def tables_and_lengths(rng, batch: int, width: int):
    tables = rng.permutation(np.arange(1, BLOCKS))[: batch * width].reshape(batch, width)
    lengths = rng.integers(1, width * BLOCK + 1, batch)
    lengths[-1] = 0  # a padding row
    return jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize(
    "heads,latent_dim,rope_dim,dtype,options",
    [
        (4, 32, 16, jnp.float32, {}),
        (40, 32, 16, jnp.float32, {"heads_per_program": 16, "num_splits": 2}),
        (16, 64, 32, jnp.bfloat16, {"pages_per_step": 1, "num_splits": 3}),
        (4, 24, 8, jnp.float32, {"pages_per_step": 2}),
    ],
)
def test_kernel_equals_the_reference(heads, latent_dim, rope_dim, dtype, options):
    rng = np.random.default_rng(heads + latent_dim)
    k, v = latent_cache(rng, latent_dim, rope_dim, dtype)
    tables, lengths = tables_and_lengths(rng, 3, 4)
    q = jnp.asarray(rng.standard_normal((3, heads, latent_dim + rope_dim)), dtype)
    args = (q, k, v, jnp.int32(1), tables, lengths)
    want = mla_reference.mla_decode_attention(*args, scale=0.2, latent_dim=latent_dim)
    got = mla_decode.mla_decode_attention(*args, scale=0.2, latent_dim=latent_dim, interpret=True, **options)
    assert got.shape == (3, heads, latent_dim)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.any(np.asarray(got[-1], np.float32))  # length 0: zeros


def test_absorbed_reference_equals_attention_over_decompressed_keys_and_values():
    """softmax(q . k) v per head with k = [c_kv W_uk | k_pe], v = c_kv W_uv equals the absorbed
    form: queries q_nope W_uk^T scored against [c_kv | k_pe], outputs taken through W_uv."""
    rng = np.random.default_rng(0)
    heads, nope, rope, vdim, r = 3, 8, 4, 6, 12
    k, v = latent_cache(rng, r, rope, jnp.float32)
    tables, lengths = tables_and_lengths(rng, 3, 3)  # the last one padding
    w_uk, w_uv = rng.standard_normal((r, heads, nope)), rng.standard_normal((r, heads, vdim))
    q_nope, q_pe = rng.standard_normal((3, heads, nope)), rng.standard_normal((3, heads, rope))
    q = jnp.asarray(np.concatenate([np.einsum("bhn,rhn->bhr", q_nope, w_uk), q_pe], -1), jnp.float32)
    latent_out = mla_reference.mla_decode_attention(q, k, v, jnp.int32(0), tables, lengths, scale=0.3, latent_dim=r)
    got = np.einsum("bhr,rhv->bhv", np.asarray(latent_out), w_uv)
    rows = np.asarray(mla_reference.join_latent(k[0, 0], v[0, 0], r))  # [NB, BS, W]
    for b in range(2):
        hist = rows[np.asarray(tables[b])].reshape(-1, r + rope)[: int(lengths[b])]
        keys = np.concatenate([np.einsum("cr,rhn->chn", hist[:, :r], w_uk), np.repeat(hist[:, None, r:], heads, 1)], -1)
        values = np.einsum("cr,rhv->chv", hist[:, :r], w_uv)
        scores = np.einsum("hd,chd->hc", np.concatenate([q_nope[b], q_pe[b]], -1), keys) * 0.3
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(got[b], np.einsum("hc,chv->hv", probs, values), rtol=1e-4, atol=1e-4)


def test_split_and_join_of_the_latent_are_inverse():
    latent = jnp.arange(2 * 48, dtype=jnp.float32).reshape(2, 48)
    k, v = mla_reference.split_latent(latent, 32)
    assert k.shape == v.shape == (2, 24)
    np.testing.assert_array_equal(mla_reference.join_latent(k, v, 32), latent)
    np.testing.assert_array_equal(k[0, :16], latent[0, :16])  # c_kv's first half, then k_pe's
    np.testing.assert_array_equal(k[0, 16:], latent[0, 32:40])
