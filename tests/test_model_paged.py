"""The paged model gives the same logits however a sequence is split into steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.config import ModelConfig
from jaxserve.model import AttentionMetadata, KVCache, LlamaModel
from kernels_pallas import get_attention_backend

BLOCK = 8
NUM_BLOCKS = 64


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
    base.update(overrides)
    return ModelConfig(**base)


def init(config):
    model = LlamaModel(config, get_attention_backend("reference"))
    cache = KVCache.zeros(config, NUM_BLOCKS, BLOCK, jnp.float32)
    meta = AttentionMetadata(jnp.zeros(4, jnp.int32), jnp.zeros((1, 2), jnp.int32),
                             jnp.array([4], jnp.int32), jnp.array([0, 4], jnp.int32))
    params = model.init(jax.random.key(0), jnp.zeros(4, jnp.int32), jnp.arange(4), cache, meta,
                        jnp.array([3]))
    # Random (not default-initialized) norms and biases so that every parameter matters.
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return model, jax.tree.unflatten(treedef, leaves)


def run_chunks(model, params, tokens, chunk_sizes, table):
    """Feed `tokens` as successive ragged-prefill steps; return logits of every position."""
    cache = KVCache.zeros(model.config, NUM_BLOCKS, BLOCK, jnp.float32)
    step = jax.jit(model.apply)
    out, start = [], 0
    for n in chunk_sizes:
        pos = np.arange(start, start + n)
        slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
        # numpy inputs: building them with jnp would compile a small program per chunk size
        meta = AttentionMetadata(slots.astype(np.int32), table[None].astype(np.int32),
                                 np.array([start + n], np.int32), np.array([0, n], np.int32))
        logits, cache = step(params, np.asarray(tokens[start:start + n], np.int32), pos.astype(np.int32), cache,
                             meta, np.arange(n, dtype=np.int32))
        out.append(np.asarray(logits))
        start += n
    return np.concatenate(out)


def run_decode(model, params, tokens, table):
    cache = KVCache.zeros(model.config, NUM_BLOCKS, BLOCK, jnp.float32)
    step = jax.jit(model.apply)
    out = []
    for p, tok in enumerate(tokens):
        meta = AttentionMetadata(np.array([table[p // BLOCK] * BLOCK + p % BLOCK], np.int32),
                                 table[None].astype(np.int32), np.array([p + 1], np.int32))
        logits, cache = step(params, np.array([tok], np.int32), np.array([p], np.int32), cache, meta,
                             np.array([0], np.int32))
        out.append(np.asarray(logits))
    return np.concatenate(out)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": True, "tie_word_embeddings": False, "num_kv_heads": 4},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
])
def test_one_piece_chunks_and_decode_agree(overrides):
    config = tiny_config(**overrides)
    model, params = init(config)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, 45)
    table = rng.permutation(np.arange(1, NUM_BLOCKS))[:8]  # scattered, never block 0
    whole = run_chunks(model, params, tokens, [45], table)
    chunked = run_chunks(model, params, tokens, [7] * 6 + [3], table)
    decoded = run_decode(model, params, tokens, table)
    np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(decoded, whole, atol=1e-5, rtol=1e-5)


def test_matches_dense_causal_attention():
    """The paged forward equals a plain dense causal forward written independently here."""
    config = tiny_config()
    model, params = init(config)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 20)
    table = np.arange(10, 13)
    paged = run_chunks(model, params, tokens, [20], table)
    np.testing.assert_allclose(paged, dense_forward(config, params["params"], tokens), atol=1e-4, rtol=1e-4)


def dense_forward(cfg, p, tokens):
    def norm(x, s):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * s

    def rope(x, pos):
        half = cfg.head_dim // 2
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
        ang = pos[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    p = jax.tree.map(np.asarray, p)
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    h = p["embed"]["embedding"][tokens]
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda a: a[i], p["layers"])
        x = norm(h, lp["attn_norm"]["scale"])
        q = rope((x @ lp["q_proj"]["kernel"]).reshape(t, cfg.num_heads, cfg.head_dim), pos)
        k = rope((x @ lp["k_proj"]["kernel"]).reshape(t, cfg.num_kv_heads, cfg.head_dim), pos)
        v = (x @ lp["v_proj"]["kernel"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        k = np.repeat(k, cfg.q_per_kv, axis=1)
        v = np.repeat(v, cfg.q_per_kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(cfg.head_dim)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(t, -1)
        h = h + o @ lp["o_proj"]["kernel"]
        x = norm(h, lp["mlp_norm"]["scale"])
        g = x @ lp["gate_proj"]["kernel"]
        h = h + (g / (1 + np.exp(-g)) * (x @ lp["up_proj"]["kernel"])) @ lp["down_proj"]["kernel"]
    h = norm(h, p["final_norm"]["scale"])
    return h @ p["embed"]["embedding"].T
