"""GGUF loading: every supported tensor type, Q/K un-permutation, config, tokenizer, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from ckpt_gguf_fixture import Q, hf_weights, llama_cpp_permute, write_tiny_gguf

from checkpoints.architectures.llama import unpermute_rope_rows
from checkpoints.errors import CheckpointError, UnsupportedCheckpointError
from checkpoints.gguf import load_gguf, supported_tensor_types
from checkpoints.orbax_io import load_orbax, save_orbax
from checkpoints.tiny_random import build_tiny_random
from jaxserve.model.rope import inverse_frequencies

REFERENCE = Path(__file__).parents[1] / "data" / "smollm2_reference.json"
TEXTS = ["Hello world!  42 apples\n\n1. x", "你好，世界。", "<|im_start|>user\nhi<|im_end|>", "def f(a):\n  return a"]


@pytest.fixture(scope="module")
def tiny():
    # intermediate 256: the FFN down projection can then hold K-quant blocks (256 values each).
    return build_tiny_random(intermediate_size=256)


def rope_rotate_half(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    d = x.shape[-1]
    freqs = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def rope_interleaved(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    d = x.shape[-1]
    freqs = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(freqs) - odd * np.sin(freqs)
    out[..., 1::2] = even * np.sin(freqs) + odd * np.cos(freqs)
    return out


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, head_dim in [(9, 64), (3, 64), (4, 16)]:
        weight = rng.standard_normal((heads * head_dim, 24))
        bias = rng.standard_normal(heads * head_dim)
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(weight, heads), heads), weight)
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(bias, heads), heads), bias)
        assert not np.array_equal(llama_cpp_permute(weight, heads), weight)


def test_unpermuted_weights_with_rotate_half_rope_match_llama_cpp_rope_on_stored_weights():
    """The reason for un-permuting: HF RoPE on un-permuted Q/K gives the same attention scores as
    llama.cpp's interleaved RoPE on the weights as stored in the file."""
    rng = np.random.default_rng(1)
    heads, head_dim, hidden, seq = 4, 16, 32, 7
    wq, wk = rng.standard_normal((2, heads * head_dim, hidden))
    x = rng.standard_normal((seq, hidden))
    pos = np.arange(seq, dtype=np.float64)

    def scores(wq_, wk_, rope):
        q = rope((x @ wq_.T).reshape(seq, heads, head_dim).swapaxes(0, 1), pos)
        k = rope((x @ wk_.T).reshape(seq, heads, head_dim).swapaxes(0, 1), pos)
        return q @ k.swapaxes(-1, -2)

    stored_q, stored_k = llama_cpp_permute(wq, heads), llama_cpp_permute(wk, heads)
    llama_cpp = scores(stored_q, stored_k, rope_interleaved)
    ours = scores(unpermute_rope_rows(stored_q, heads), unpermute_rope_rows(stored_k, heads), rope_rotate_half)
    np.testing.assert_allclose(ours, llama_cpp, rtol=1e-10, atol=1e-10)
    mixed = scores(stored_q, stored_k, rope_rotate_half)
    assert not np.allclose(mixed, llama_cpp, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_loads_every_tensor_type_exactly(tmp_path, arch):
    model = build_tiny_random(intermediate_size=256, attention_bias=(arch == "qwen2"))
    types = {"ffn_down.weight": Q.Q4_K} if arch == "qwen2" else None
    expected = write_tiny_gguf(tmp_path / "m.gguf", model, arch=arch, types=types)
    loaded = load_gguf(tmp_path / "m.gguf")
    got = hf_weights(loaded)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        # Quantized, but still close to the original weights (a wrong layout would not be).
        original = hf_weights(model)[name]
        if "ffn_down" not in name:  # K-quant blocks are random bytes, unrelated to the original
            assert np.abs(got[name] - original).max() <= 0.25 * np.abs(original).max() + 1e-6, name
    # GGUF stores eps as float32.
    assert loaded.config == dataclasses.replace(model.config, architecture=arch, rms_norm_eps=float(np.float32(1e-5)))


def test_tiny_gguf_tokenizer_and_chat_template(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, pre="default")  # tiny-random splits like GPT-2
    bundle = load_gguf(tmp_path / "m.gguf").tokenizer_bundle
    for text in TEXTS:
        assert bundle.tokenizer.encode(text).ids == tiny.tokenizer_bundle.tokenizer.encode(text).ids
    assert bundle.chat_template == tiny.tokenizer_bundle.chat_template
    assert bundle.special_tokens["eos_token"] == "<|im_end|>"
    assert bundle.eos_token_ids == tiny.config.eos_token_ids
    assert bundle.bos_token_id == tiny.tokenizer_bundle.bos_token_id


def test_smollm_pre_tokenizer_splits_digits_off_after_whitespace_runs(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, pre="smollm")
    pre = load_gguf(tmp_path / "m.gguf").tokenizer_bundle.tokenizer.pre_tokenizer
    pieces = [piece for piece, _ in pre.pre_tokenize_str("a  42 b1")]
    assert pieces == ["a", "ĠĠ", "4", "2", "Ġb", "1"]


def test_tied_head_when_file_has_no_output_weight(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, skip=("output.weight",))
    loaded = load_gguf(tmp_path / "m.gguf")
    assert loaded.config.tie_word_embeddings
    assert "lm_head" not in loaded.params


def test_bfloat16_load(tmp_path, tiny):
    expected = write_tiny_gguf(tmp_path / "m.gguf", tiny)
    loaded = load_gguf(tmp_path / "m.gguf", dtype="bfloat16")
    assert loaded.params["layers"]["q_proj"]["kernel"].dtype.name == "bfloat16"
    np.testing.assert_allclose(
        loaded.params["embed"]["embedding"].astype(np.float32), expected["token_embd.weight"], rtol=1e-2, atol=1e-2
    )


def llama_cpp_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The divisors llama.cpp's converter writes as `rope_freqs` for Llama 3.1-style scaling,
    following its code (not ours): 1 for short wavelengths, `factor` for long, blended between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama31_rope_freqs_give_the_llama3_scaled_frequencies(tmp_path, tiny):
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    config = tiny.config
    factors = llama_cpp_rope_factors(config.head_dim, config.rope_theta, llama3)
    assert len(set(factors.tolist())) > 2  # unscaled, scaled and blended frequencies all occur
    write_tiny_gguf(tmp_path / "m.gguf", tiny, rope_factors=factors)
    loaded = load_gguf(tmp_path / "m.gguf")
    assert loaded.config.rope_scaling["rope_type"] == "frequency_factors"
    np.testing.assert_allclose(
        inverse_frequencies(loaded.config),
        inverse_frequencies(dataclasses.replace(config, rope_scaling=llama3)),
        rtol=1e-6,
    )
    assert set(loaded.params) == set(tiny.params)  # rope_freqs is config, not a parameter
    save_orbax(loaded, tmp_path / "converted")  # `jaxserve convert` keeps the factors
    assert load_orbax(tmp_path / "converted").config.rope_scaling == loaded.config.rope_scaling
    write_tiny_gguf(tmp_path / "bad.gguf", tiny, rope_factors=factors[:-1])
    with pytest.raises(CheckpointError, match="rope_freqs has shape"):
        load_gguf(tmp_path / "bad.gguf")


def test_yarn_scaling_keys_become_the_hugging_face_rope_scaling(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, yarn=(4.0, 4096))
    assert load_gguf(tmp_path / "m.gguf").config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_truncated_file(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny)
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 2000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            load_gguf(tmp_path / "cut.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"definitely not a model" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")


def test_unsupported_architecture(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, arch="phi3")
    with pytest.raises(UnsupportedCheckpointError, match="architecture 'phi3' is not supported"):
        load_gguf(tmp_path / "m.gguf")


def test_unsupported_quantization_type(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, types={"attn_v.weight": Q.Q8_K})
    with pytest.raises(UnsupportedCheckpointError, match="attn_v.weight has type Q8_K; supported types: .*IQ4_XS"):
        load_gguf(tmp_path / "m.gguf")


def test_unsupported_pre_tokenizer(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, pre="some-new-model")
    with pytest.raises(UnsupportedCheckpointError, match="pre-tokenizer 'some-new-model'"):
        load_gguf(tmp_path / "m.gguf")


def test_missing_tensor(tmp_path, tiny):
    write_tiny_gguf(tmp_path / "m.gguf", tiny, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensors: blk.1.ffn_up.weight"):
        load_gguf(tmp_path / "m.gguf")


@pytest.mark.integration
def test_default_model_matches_transformers_weights():
    """Our un-permuted Q/K rows equal the weights transformers loads from the same GGUF."""
    from checkpoints.registry import DEFAULT_MODEL, fetch_gguf

    reference = json.loads(REFERENCE.read_text())
    model = load_gguf(fetch_gguf(DEFAULT_MODEL))
    assert model.config.num_layers == 30 and model.config.tie_word_embeddings
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim) == (9, 3, 64)
    assert model.config.rope_theta == 100000.0 and model.config.vocab_size == 49152
    for layer, rows in reference["weights"]["layer"].items():
        for proj in ("q_proj", "k_proj"):
            got = model.params["layers"][proj]["kernel"][int(layer), 0]
            np.testing.assert_array_equal(got, np.float32(rows[f"{proj}_row0"]), err_msg=f"{proj} layer {layer}")
    assert gguf.GGUFReader(fetch_gguf(DEFAULT_MODEL)).fields  # the file itself is intact


@pytest.mark.parametrize("qtype", sorted(supported_tensor_types(), key=lambda t: t.name))
def test_every_type_gguf_dequantizes_loads_into_its_place(tmp_path, tiny, qtype):
    """Every tensor type of gguf.quants (Q5_0, Q5_1, Q2_K..Q5_K, the IQ types, ...) loads; the
    values are gguf-py's dequantization of the file's blocks, in the tensor's place."""
    expected = write_tiny_gguf(tmp_path / "m.gguf", tiny, types={"ffn_down.weight": qtype})
    got = hf_weights(load_gguf(tmp_path / "m.gguf"))
    for name in ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{qtype.name} {name}")
