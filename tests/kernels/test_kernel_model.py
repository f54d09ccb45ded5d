"""A small random Llama generates the same greedy tokens with the serving backends (pallas, jax
and cpu) as with the reference backend; so do a Mistral whose sliding window (8 tokens) is
shorter than its prompts, a Gemma 3 whose local (windowed) and global layers interleave, and a
gpt-oss (attention sinks, alternating windows, biased experts).

Two sequences are prefilled together (ragged, the second in two chunks), then decoded in one
batch with a padded entry; the pallas kernels run interpreted on CPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.config import ModelConfig
from jaxserve.model import AttentionMetadata, DecoderModel, KVCache
from kernels_pallas import cpu_build, get_attention_backend

BLOCK, NUM_BLOCKS, WIDTH = 8, 32, 4
LLAMA = ModelConfig(
    vocab_size=101,
    hidden_size=96,
    intermediate_size=128,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
CONFIGS = {
    "llama": LLAMA,
    "mistral": dataclasses.replace(LLAMA, architecture="mistral", sliding_window=8),
    "gemma3": dataclasses.replace(
        LLAMA,
        architecture="gemma3",
        qk_norm=True,
        post_norms=True,
        hidden_act="gelu_tanh",
        scale_embeddings=True,
        query_pre_attn_scalar=20.0,
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention"),
        rope_theta=1_000_000.0,
        rope_local_theta=10_000.0,
    ),
    # attention sinks in every backend's kernels, alternating windows, biased experts
    "gpt_oss": dataclasses.replace(
        LLAMA,
        architecture="gpt_oss",
        tie_word_embeddings=False,
        attention_bias=True,
        attention_out_bias=True,
        attention_sinks=True,
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention"),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        swiglu_limit=7.0,
    ),
}
BACKENDS = ["pallas", "jax"] + (["cpu"] if cpu_build.available() else [])


def init_params(config):
    """Random weights (norm scales too, so every weight matters), shaped by the model's init."""
    model = DecoderModel(config, get_attention_backend("reference"))
    cache = KVCache.zeros(config, NUM_BLOCKS, BLOCK, jnp.float32)
    meta = AttentionMetadata(
        jnp.zeros(4, jnp.int32), jnp.zeros((1, 2), jnp.int32), jnp.array([4], jnp.int32), jnp.array([0, 4], jnp.int32)
    )
    shapes = jax.eval_shape(
        model.init, jax.random.key(0), jnp.zeros(4, jnp.int32), jnp.arange(4), cache, meta, jnp.array([3])
    )
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype), shapes)


def kv_slots(table, positions):
    return np.asarray(table[positions // BLOCK] * BLOCK + positions % BLOCK, np.int32)


def generate(config, backend_name, params, prompts, tables, steps):
    # The pallas backend interprets on CPU by itself (or as $JAXSERVE_PALLAS_INTERPRET says).
    apply = jax.jit(DecoderModel(config, get_attention_backend(backend_name)).apply)
    cache = KVCache.zeros(config, NUM_BLOCKS, BLOCK, jnp.float32)
    a, b = prompts
    cut = len(b) - 4
    rows = len(a) + cut  # both prefill steps use this token bucket and 2 sequences
    # Step 1: all of prompt a and the first chunk of prompt b.
    logits, cache = apply(
        params,
        jnp.asarray(np.concatenate([a, b[:cut]])),
        jnp.asarray(np.concatenate([np.arange(len(a)), np.arange(cut)])),
        cache,
        AttentionMetadata(
            jnp.asarray(np.concatenate([kv_slots(tables[0], np.arange(len(a))), kv_slots(tables[1], np.arange(cut))])),
            jnp.asarray(tables),
            jnp.array([len(a), cut], jnp.int32),
            jnp.array([0, len(a), rows], jnp.int32),
        ),
        jnp.array([len(a) - 1, rows - 1]),
    )
    first_a = logits[0]
    # Step 2: the rest of prompt b over its cached chunk, then padding rows and a padded sequence.
    pad = rows - (len(b) - cut)
    logits, cache = apply(
        params,
        jnp.asarray(np.pad(b[cut:], (0, pad))),
        jnp.asarray(np.pad(np.arange(cut, len(b)), (0, pad))),
        cache,
        AttentionMetadata(
            jnp.asarray(np.pad(kv_slots(tables[1], np.arange(cut, len(b))), (0, pad))),
            jnp.asarray(np.stack([tables[1], np.zeros(WIDTH, np.int32)])),
            jnp.array([len(b), 0], jnp.int32),
            jnp.array([0, len(b) - cut, len(b) - cut], jnp.int32),
        ),
        jnp.array([len(b) - cut - 1, 0]),
    )
    all_logits = [np.stack([first_a, logits[0]])]
    tokens = [np.argmax(all_logits[-1], axis=-1)]
    lengths = np.array([len(a), len(b)])
    padded_tables = np.concatenate([tables, np.zeros((1, WIDTH), np.int32)])
    for _ in range(steps):
        kv_slot = np.array([kv_slots(tables[0], lengths[:1])[0], kv_slots(tables[1], lengths[1:])[0], 0], np.int32)
        meta = AttentionMetadata(
            jnp.asarray(kv_slot), jnp.asarray(padded_tables), jnp.asarray(np.append(lengths + 1, 0), jnp.int32)
        )
        logits, cache = apply(
            params,
            jnp.asarray(np.append(tokens[-1], 0)),
            jnp.asarray(np.append(lengths, 0)),
            cache,
            meta,
            jnp.arange(2),
        )
        lengths = lengths + 1
        all_logits.append(np.asarray(logits))
        tokens.append(np.argmax(all_logits[-1], axis=-1))
    return np.stack(tokens, axis=1), np.stack(all_logits, axis=1)


@functools.cache
def reference_run(family):
    """A family's weights, prompts and block tables, and the reference backend's tokens and logits
    on them: computed once per family (the same for every backend compared with them)."""
    config = CONFIGS[family]
    rng = np.random.default_rng(0)
    params = init_params(config)
    prompts = (rng.integers(0, config.vocab_size, 11), rng.integers(0, config.vocab_size, 17))
    tables = rng.permutation(np.arange(1, NUM_BLOCKS))[: 2 * WIDTH].reshape(2, WIDTH).astype(np.int32)
    with jax.default_matmul_precision("float32"):
        want = generate(config, "reference", params, prompts, tables, steps=6)
    return params, prompts, tables, want


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_match_reference(backend, family):
    params, prompts, tables, (want_tokens, want_logits) = reference_run(family)
    # IEEE f32 dense matmuls: on a GPU the default (TF32) would blur a 1e-4 comparison.
    with jax.default_matmul_precision("float32"):
        got_tokens, got_logits = generate(CONFIGS[family], backend, params, prompts, tables, steps=6)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got_tokens, want_tokens)
