"""The paged model gives the same logits however a sequence is split into steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.config import ModelConfig
from jaxserve.model import AttentionMetadata, DecoderModel, KVCache
from jaxserve.model.layout import panel_kernels, unstack_layers
from kernels_pallas import cpu_build, cpu_matmul, get_attention_backend

BLOCK = 8
NUM_BLOCKS = 64


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    base.update(overrides)
    return ModelConfig(**base)


def init(config):
    model = DecoderModel(config, get_attention_backend("reference"))
    cache = KVCache.zeros(config, NUM_BLOCKS, BLOCK, jnp.float32)
    meta = AttentionMetadata(
        jnp.zeros(4, jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.array([4], jnp.int32), jnp.array([0, 4], jnp.int32)
    )
    params = model.init(jax.random.key(0), jnp.zeros(4, jnp.int32), jnp.arange(4), cache, meta, jnp.array([3]))
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
        kv_slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
        # numpy inputs: building them with jnp would compile a small program per chunk size
        meta = AttentionMetadata(
            kv_slots.astype(np.int32),
            table[None].astype(np.int32),
            np.array([start + n], np.int32),
            np.array([0, n], np.int32),
        )
        logits, cache = step(
            params,
            np.asarray(tokens[start : start + n], np.int32),
            pos.astype(np.int32),
            cache,
            meta,
            np.arange(n, dtype=np.int32),
        )
        out.append(np.asarray(logits))
        start += n
    return np.concatenate(out)


def run_decode(model, params, tokens, table):
    cache = KVCache.zeros(model.config, NUM_BLOCKS, BLOCK, jnp.float32)
    step = jax.jit(model.apply)
    out = []
    for p, tok in enumerate(tokens):
        meta = AttentionMetadata(
            np.array([table[p // BLOCK] * BLOCK + p % BLOCK], np.int32),
            table[None].astype(np.int32),
            np.array([p + 1], np.int32),
        )
        logits, cache = step(
            params, np.array([tok], np.int32), np.array([p], np.int32), cache, meta, np.array([0], np.int32)
        )
        out.append(np.asarray(logits))
    return np.concatenate(out)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "tie_word_embeddings": False, "num_kv_heads": 4},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ],
)
def test_one_piece_chunks_and_decode_agree(overrides):
    config = tiny_config(**overrides)
    model, params = init(config)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, 45)
    table = rng.permutation(np.arange(1, NUM_BLOCKS))[:8]  # scattered, never block 0
    whole = run_chunks(model, params, tokens, [45], table)
    chunked = run_chunks(model, params, tokens, [7] * 6 + [3], table)
    decoded = run_decode(model, params, tokens, table)
    np.testing.assert_allclose(chunked, whole, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(decoded, whole, atol=1e-4, rtol=1e-5)


def test_unrolled_layers_on_unstacked_weights_equal_the_scan():
    """`unroll_layers` runs the same layers: the stacked weights split per layer give the
    scanned model's logits, for a prefill in chunks and for decode steps."""
    config = tiny_config(num_layers=3)
    model, params = init(config)
    unrolled = DecoderModel(config, model.backend, unroll_layers=True)
    split = {"params": unstack_layers(params["params"], config.num_layers, lambda leaf, i: leaf[i])}
    assert "layers" not in split["params"] and split["params"]["layers_2"]["q_proj"]["kernel"].shape == (64, 64)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, config.vocab_size, 21)
    table = rng.permutation(np.arange(1, NUM_BLOCKS))[:3]
    np.testing.assert_allclose(
        run_chunks(unrolled, split, tokens, [13, 8], table),
        run_chunks(model, params, tokens, [13, 8], table),
        atol=1e-5,
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        run_decode(unrolled, split, tokens[:6], table),
        run_decode(model, params, tokens[:6], table),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")
def test_cpu_layer_matmul_gives_the_scan_logits():
    """The model with `cpu_matmul` (the cpu kernel reading each layer of the stacks, stored in
    its panels, in place, and the tied head's kernel) gives the logits of XLA's dots on the
    [K, N] layout, for chunks of one row, a few rows and more rows than one unit of its work, for
    decode steps, and with biases; kernels whose features are not a multiple of its panel stay
    as they were."""
    config = tiny_config(num_layers=3, attention_bias=True, num_kv_heads=1)
    model, params = init(config)
    matmul = cpu_matmul.kernels()
    native = DecoderModel(config, model.backend, cpu_matmul=matmul)
    panelled = panel_kernels(params, matmul)
    layers, stored = params["params"]["layers"], panelled["params"]["layers"]
    for name, proj in layers.items():
        if "kernel" in proj:
            features = proj["kernel"].shape[-1]
            want = matmul.stored_shape(*proj["kernel"].shape) if matmul.takes(features) else proj["kernel"].shape
            assert stored[name]["kernel"].shape == want
    assert matmul.takes(layers["q_proj"]["kernel"].shape[-1])
    assert not matmul.takes(layers["k_proj"]["kernel"].shape[-1])  # 16 features: XLA's dot
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, config.vocab_size, 120)
    table = rng.permutation(np.arange(1, NUM_BLOCKS))[:15]
    chunks = [1, 7, 100, 12]
    np.testing.assert_allclose(
        run_chunks(native, panelled, tokens, chunks, table),
        run_chunks(model, params, tokens, chunks, table),
        atol=1e-5,
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        run_decode(native, panelled, tokens[:6], table),
        run_decode(model, params, tokens[:6], table),
        atol=1e-5,
        rtol=1e-5,
    )


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


def meta_for(tables, starts, counts, decodes=None):
    """Host arrays of one step: ragged chunks (sequence i: `counts[i]` tokens from position
    `starts[i]` over block table `tables[i]`), then with `decodes` = [(table, position)] a
    mixed step's decode sequences, padded to `decode_rows` of them."""
    kv_slots, rows, query_start, seq_lens, all_tables = [], 0, [0], [], list(tables)
    for table, start, n in zip(tables, starts, counts):
        pos = np.arange(start, start + n)
        kv_slots += list(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        rows += n
        query_start.append(rows)
        seq_lens.append(start + n)
    decode_rows = None
    if decodes is not None:
        table_rows, pad = decodes
        decode_rows = []
        for table, pos in table_rows:
            kv_slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
            decode_rows.append(rows)
            rows += 1
            all_tables.append(table)
            seq_lens.append(pos + 1)
        padding = pad - len(table_rows)
        decode_rows += [rows + 3] * padding  # T: three padding token rows follow
        all_tables += [np.zeros_like(tables[0])] * padding
        seq_lens += [0] * padding
        kv_slots += [0] * 3
        decode_rows = np.array(decode_rows, np.int32)
    return AttentionMetadata(
        np.array(kv_slots, np.int32),
        np.stack(all_tables).astype(np.int32),
        np.array(seq_lens, np.int32),
        np.array(query_start, np.int32),
        decode_rows,
    )


@pytest.mark.parametrize("backend", ["jax", "cpu", "reference", "pallas"])
def test_mixed_step_equals_a_prefill_step_and_a_decode_step(backend):
    """Prefill chunks and decodes in one mixed step (one pass over the weights) give the logits
    and cache writes of a prefill step of the chunks and a decode step of the decodes."""
    config = tiny_config()
    _, params = init(config)
    model = DecoderModel(config, get_attention_backend(backend))
    step = jax.jit(model.apply)
    rng = np.random.default_rng(2)
    tables = [np.arange(1, 9), np.arange(9, 17), np.arange(17, 25), np.arange(25, 33)]
    history = [rng.integers(0, config.vocab_size, n) for n in (11, 30)]  # two decoding sequences
    prompts = [rng.integers(0, config.vocab_size, n) for n in (9, 5)]  # two chunks (one continued)
    cache = KVCache.zeros(config, NUM_BLOCKS, BLOCK, jnp.float32)
    # The decoders' history and the second prompt's first 3 tokens are cached already.
    first = [history[0], history[1], prompts[1][:3]]
    meta = meta_for(tables[:2] + tables[3:], [0, 0, 0], [len(t) for t in first])
    _, cache = step(
        params,
        np.concatenate(first).astype(np.int32),
        np.concatenate([np.arange(len(t)) for t in first]).astype(np.int32),
        cache,
        meta,
        np.zeros(1, np.int32),
    )
    chunk_tokens = np.concatenate([prompts[0], prompts[1][3:]]).astype(np.int32)
    chunk_pos = np.concatenate([np.arange(9), np.arange(3, 5)]).astype(np.int32)
    new = rng.integers(0, config.vocab_size, 2).astype(np.int32)  # the decoders' next tokens
    decode_pos = np.array([11, 30], np.int32)

    prefill_logits, split = step(
        params,
        chunk_tokens,
        chunk_pos,
        cache,
        meta_for([tables[2], tables[3]], [0, 3], [9, 2]),
        np.array([8, 10], np.int32),
    )
    decode_meta = AttentionMetadata(
        np.array([tables[i][p // BLOCK] * BLOCK + p % BLOCK for i, p in enumerate(decode_pos)], np.int32),
        np.stack(tables[:2]).astype(np.int32),
        decode_pos + 1,
    )
    decode_logits, split = step(params, new, decode_pos, split, decode_meta, np.arange(2, dtype=np.int32))

    tokens = np.concatenate([chunk_tokens, new, np.zeros(3, np.int32)])
    positions = np.concatenate([chunk_pos, decode_pos, np.zeros(3, np.int32)])
    meta = meta_for([tables[2], tables[3]], [0, 3], [9, 2], ([(tables[0], 11), (tables[1], 30)], 4))
    mixed_logits, mixed = step(params, tokens, positions, cache, meta, np.array([8, 10, 11, 12], np.int32))

    np.testing.assert_allclose(mixed_logits, np.concatenate([prefill_logits, decode_logits]), atol=1e-5, rtol=1e-5)
    used = np.concatenate(tables)  # block 0 takes the padding rows' writes in both
    np.testing.assert_allclose(np.asarray(mixed.k)[:, :, used], np.asarray(split.k)[:, :, used], atol=1e-5)
    np.testing.assert_allclose(np.asarray(mixed.v)[:, :, used], np.asarray(split.v)[:, :, used], atol=1e-5)
