"""The encoder's forward pass, pooling plug-ins and loaders on tiny random BERT and nomic-bert
models (weights drawn from the declaration), and the MiniLM directory's configuration."""

from __future__ import annotations

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from encoder_dirs import TINY, write_sentence_transformers

from checkpoints.encoders import EncoderConfig, is_encoder_spec, load_encoder
from checkpoints.encoders.load import encoder_config_from_dir, load_sentence_transformers_dir
from checkpoints.encoders.weights import declare_encoder
from checkpoints.params import checkpoint_names, iter_leaves
from checkpoints.weights import flat, random_tree
from jaxserve.encoder.batcher import EncoderBatcher, EncoderBuckets, EncoderRequest, token_bucket_sizes
from jaxserve.model.encoder import encode, pooled_sums
from jaxserve.pooling import POOLERS, ClsPooler, LastTokenPooler, MeanPooler, Pooler, PromptPooling
from server.embedding_inputs import finish_embedding


def _model(architecture: str):
    config = EncoderConfig(architecture, **TINY, max_position_embeddings=64)
    params = jax.tree.map(jnp.asarray, random_tree(declare_encoder(config), 0, np.float32))
    return config, params


@pytest.mark.parametrize("architecture", ["bert", "nomic_bert"])
def test_attention_is_bidirectional_and_padding_is_invisible(architecture):
    config, params = _model(architecture)
    ids = np.array([[1, 5, 7, 9, 2, 0, 0, 0]], np.int32)
    h = np.asarray(encode(config, params, ids, np.array([5], np.int32)))
    changed_last = ids.copy()
    changed_last[0, 3] = 11
    h2 = np.asarray(encode(config, params, changed_last, np.array([5], np.int32)))
    assert np.abs(h[0, 0] - h2[0, 0]).max() > 1e-3  # the first token sees a later one: no causal mask
    padded = np.zeros((2, 16), np.int32)
    padded[0, :5] = ids[0, :5]
    padded[1, :8] = 3  # another row does not leak into this one
    padded[0, 5:] = 42  # nor do padding tokens, whatever they are
    h3 = np.asarray(encode(config, params, padded, np.array([5, 8], np.int32)))
    np.testing.assert_allclose(h3[0, :5], h[0, :5], atol=1e-5)


@pytest.mark.parametrize("architecture", ["bert", "nomic_bert"])
def test_pooled_sums_take_the_rows_the_pooler_takes(architecture):
    config, params = _model(architecture)
    ids = np.array([[1, 5, 7, 9, 2, 0]], np.int32)
    lengths = np.array([5], np.int32)
    h = np.asarray(encode(config, params, ids, lengths))[0]
    for pooler, want in [(MeanPooler(), h[:5].mean(0)), (ClsPooler(), h[0]), (LastTokenPooler(), h[4])]:
        rows = pooler.rows(0, 5, 5)
        weights = np.zeros((1, 6), np.float32)
        weights[0, rows.start : rows.stop] = 1
        got = np.asarray(pooled_sums(config, params, ids, lengths, weights))[0] / len(rows)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_poolers_are_one_protocol_and_pool_chunks_once():
    for name, pooler in POOLERS.items():
        takes: Pooler = pooler  # each satisfies the declared interface
        assert takes.name == name and takes.rows(0, 0, 5) == range(0)
    cls = PromptPooling("cls")
    assert cls.positions(0, 4, 10) == range(0, 1) and cls.first_needed(10) == 0  # row 0 must be computed
    cls.on_launched(range(0, 1))
    assert not cls.positions(0, 4, 10) and not cls.positions(4, 4, 10) and cls.first_needed(10) is None
    with pytest.raises(ValueError, match="unknown pooling"):
        PromptPooling("max")


def test_matryoshka_shortening_and_normalisation():
    v = np.arange(1.0, 9.0, dtype=np.float32)
    full = finish_embedding(v, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(full), 1.0, rtol=1e-6)
    np.testing.assert_allclose(finish_embedding(v, normalize=False), v)
    short = finish_embedding(v, normalize=True, dimensions=3)
    standardised = (v - v.mean()) / np.sqrt(v.var() + 1e-5)
    np.testing.assert_allclose(short, standardised[:3] / np.linalg.norm(standardised[:3]), rtol=1e-6)


def _queue(batcher: EncoderBatcher, lengths: list[int], start: int = 0) -> None:
    for i, n in enumerate(lengths, start):
        batcher.add(EncoderRequest(str(i), [1] * n, PromptPooling("mean")))


def _steps(batcher: EncoderBatcher) -> list[tuple[list[str], tuple[int, int]]]:
    out = []
    while batcher.waiting:
        batch, shape = batcher.next_batch()
        out.append(([r.request_id for r in batch], shape))
    return out


def test_token_buckets_are_at_most_one_and_a_half_apart():
    assert token_bucket_sizes(256) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert token_bucket_sizes(100) == (16, 24, 32, 48, 64, 96, 100) and token_bucket_sizes(12) == (12,)
    buckets = EncoderBuckets(max_len=256, max_rows=64, token_budget=512)
    assert [buckets.tokens_bucket(n) for n in (1, 16, 17, 25, 33, 65, 129, 193)] == [16, 16, 24, 32, 48, 96, 192, 256]
    assert buckets.rows_for(16) == (1, 2, 4, 8, 16, 32) and buckets.rows_for(24) == (1, 2, 4, 8, 16, 21)
    assert len(buckets.all()) == 37 and all(rows * tokens <= 512 for rows, tokens in buckets.all())


def test_batcher_groups_a_token_bucket_and_pads_nothing_longer():
    buckets = EncoderBuckets(max_len=64, max_rows=8, token_budget=128)
    assert (8, 16) in buckets.all() and (2, 64) in buckets.all() and (4, 64) not in buckets.all()
    batcher = EncoderBatcher(buckets)
    _queue(batcher, [10, 12, 40, 60, 5])
    # the 5-token input joins the first step (its bucket); no short input is padded to 48 or 64
    assert _steps(batcher) == [(["0", "1", "4"], (4, 16)), (["2"], (1, 48)), (["3"], (1, 64))]
    _queue(batcher, [60, 5, 5, 5, 5, 5, 5, 5])
    assert _steps(batcher) == [(["0"], (1, 64)), ([str(i) for i in range(1, 8)], (8, 16))]
    with pytest.raises(ValueError, match="1 to 64"):
        batcher.add(EncoderRequest("x", [1] * 65, PromptPooling("mean")))


def test_rows_a_step_pads_carry_the_longest_shorter_inputs():
    batcher = EncoderBatcher(EncoderBuckets(max_len=64, max_rows=8, token_budget=256))
    _queue(batcher, [30, 28, 31, 10, 20, 22, 60])
    # three 32-token inputs make a 4-row step: its fourth row takes the earliest 24-token input
    assert _steps(batcher) == [(["0", "1", "2", "4"], (4, 32)), (["3"], (1, 16)), (["5"], (1, 24)), (["6"], (1, 64))]


def test_a_bucket_with_more_inputs_than_a_step_holds_runs_them_in_arrival_order():
    batcher = EncoderBatcher(EncoderBuckets(max_len=64, max_rows=8, token_budget=128))
    _queue(batcher, [16] * 10 + [3])
    assert _steps(batcher) == [([str(i) for i in range(8)], (8, 16)), (["8", "9", "10"], (4, 16))]


@pytest.mark.parametrize("max_len, max_rows, budget", [(256, 64, 512), (64, 8, 256), (64, 4, 64)])
def test_every_step_takes_the_oldest_fits_its_shape_and_waits_are_bounded(max_len, max_rows, budget):
    """Inputs arrive between steps, of random lengths: each step holds the oldest waiting input and
    is a compiled shape within the budget, and an input is served within as many steps as there
    were inputs ahead of it when it arrived, plus one."""
    rng = np.random.default_rng(0)
    buckets = EncoderBuckets(max_len, max_rows, budget)
    batcher = EncoderBatcher(buckets)
    deadline: dict[str, int] = {}
    served: set[str] = set()
    arrived, step = 0, 0
    while arrived < 600 or batcher.waiting:
        for n in rng.integers(1, max_len + 1, size=rng.integers(0, 12) if arrived < 600 else 0):
            deadline[str(arrived)] = step + len(batcher.waiting) + 1
            _queue(batcher, [int(n)], arrived)
            arrived += 1
        if not batcher.waiting:
            continue
        oldest = batcher.waiting[0].request_id
        batch, (rows, tokens) = batcher.next_batch()
        step += 1
        ids = [r.request_id for r in batch]
        assert ids[0] == oldest and ids == sorted(ids, key=int)  # the oldest first, arrival order
        assert (rows, tokens) in buckets.all() and rows * tokens <= max(budget, tokens)
        assert len(batch) <= rows and max(len(r.token_ids) for r in batch) <= tokens
        assert all(step <= deadline[i] for i in ids) and not served & set(ids)
        served |= set(ids)
    assert served == set(deadline)


def test_sentence_transformers_directory_loads_its_weights_and_config(tmp_path):
    params = write_sentence_transformers(
        tmp_path, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, normalize=False
    )
    assert is_encoder_spec(str(tmp_path))
    loaded = load_sentence_transformers_dir(tmp_path)
    assert (loaded.config.pooling, loaded.config.normalize, loaded.config.max_len) == ("cls", False, 32)
    for path, value in iter_leaves(loaded.params):
        np.testing.assert_array_equal(value, params[path], err_msg=path)
    assert loaded.tokenizer_bundle.tokenizer.encode("hello worlds").ids == [2, 4, 5, 6, 3]  # not padded
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(Exception, match="CLS, mean or last token"):
        encoder_config_from_dir(tmp_path)


def test_decoder_specs_are_not_encoders():
    assert not is_encoder_spec("tiny-random") and not is_encoder_spec("/no/such/dir")
    assert is_encoder_spec("all-minilm-l6-v2") and is_encoder_spec("nomic-embed-text-v1.5")


def _write_gguf(path, arch: str, config: EncoderConfig, params: dict) -> None:
    """A tiny random `bert` / `nomic-bert` GGUF in llama.cpp's layout: tensor names from the
    declaration, `[out, in]` kernels, a WordPiece vocabulary with llama.cpp's word-start marks."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 2), ("context_length", 64), ("embedding_length", 32)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.feed_forward_length", 64)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-12)
    writer.add_float32(f"{arch}.rope.freq_base", 1000.0)
    writer.add_uint32(f"{arch}.pooling_type", 2)  # CLS
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "\u2581hello", "\u2581world", "s"] + [
        f"\u2581w{i}" for i in range(43)
    ]
    writer.add_string("tokenizer.ggml.model", "bert")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 3] + [1] * (len(tokens) - 4))
    for key, value in [("bos_token_id", 2), ("seperator_token_id", 3), ("unknown_token_id", 1)]:
        writer.add_uint32(f"tokenizer.ggml.{key}", value)
    for path_, weight in flat(declare_encoder(config)).items():
        for name, index in checkpoint_names(weight, weight.gguf):
            part = params[path_][index]
            writer.add_tensor(name, np.ascontiguousarray(part.swapaxes(-1, -2) if weight.is_kernel else part))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("gguf_arch", "architecture"), [("nomic-bert", "nomic_bert"), ("bert", "bert")])
def test_a_gguf_encoder_loads_its_weights_config_and_wordpiece(tmp_path, gguf_arch, architecture):
    config = EncoderConfig(architecture, **{**TINY, "max_len": 64}, max_position_embeddings=64)
    params = dict(iter_leaves(random_tree(declare_encoder(config), 2, np.float32)))
    _write_gguf(tmp_path / "tiny.gguf", gguf_arch, config, params)
    assert is_encoder_spec(str(tmp_path / "tiny.gguf"))
    loaded = load_encoder(str(tmp_path / "tiny.gguf"))
    assert (loaded.config.architecture, loaded.config.pooling, loaded.config.rope_theta) == (architecture, "cls", 1000)
    for path, value in iter_leaves(loaded.params):
        np.testing.assert_array_equal(value, params[path], err_msg=path)
    # "hello worlds": word-start pieces lose their mark, the others become "##" continuations.
    assert loaded.tokenizer_bundle.tokenizer.encode("Hello worlds").ids == [2, 4, 5, 6, 3]
