"""Hugging Face directories: safetensors round trips, tokenizer files, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints.errors import CheckpointError, UnsupportedCheckpointError
from checkpoints.hf import INDEX_FILE, load_hf_dir, save_hf_dir
from checkpoints.params import iter_leaves
from checkpoints.tiny_random import build_tiny_random


def assert_same_params(a, b):
    leaves_a, leaves_b = dict(iter_leaves(a)), dict(iter_leaves(b))
    assert sorted(leaves_a) == sorted(leaves_b)
    for path, value in leaves_a.items():
        assert leaves_b[path].dtype == value.dtype, path
        np.testing.assert_array_equal(leaves_b[path], value, err_msg=path)


def save(model, path, **kwargs):
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, path, **kwargs)


@pytest.mark.parametrize(
    "variant",
    [{}, {"attention_bias": True, "tie_word_embeddings": True, "architecture": "qwen2"}],
    ids=["llama-untied", "qwen2-bias-tied"],
)
@pytest.mark.parametrize("max_shard_bytes", [None, 40_000], ids=["one-file", "sharded"])
def test_round_trip(tmp_path, variant, max_shard_bytes):
    model = build_tiny_random(**variant)
    save(model, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / INDEX_FILE).exists() == (max_shard_bytes is not None)
    if max_shard_bytes:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    loaded = load_hf_dir(tmp_path)
    assert loaded.config == model.config
    assert_same_params(model.params, loaded.params)
    bundle = loaded.tokenizer_bundle
    assert bundle.tokenizer.to_str() == model.tokenizer_bundle.tokenizer.to_str()
    assert bundle.chat_template == model.tokenizer_bundle.chat_template
    assert bundle.special_tokens == model.tokenizer_bundle.special_tokens
    assert bundle.eos_token_ids == model.tokenizer_bundle.eos_token_ids


def test_bfloat16_round_trip(tmp_path):
    model = build_tiny_random(dtype="bfloat16")
    save(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_same_params(model.params, load_hf_dir(tmp_path, dtype="bfloat16").params)


def test_load_casts_to_requested_dtype(tmp_path):
    model = build_tiny_random()
    save(model, tmp_path)
    loaded = load_hf_dir(tmp_path, dtype="bf16")
    assert loaded.params["embed"]["embedding"].dtype.name == "bfloat16"


def test_tokenizer_config_variants(tmp_path):
    """Named chat templates (a list) and a separate chat_template.jinja, as transformers writes them."""
    model = build_tiny_random()
    save(model, tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 1 }}"}]
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    config_file.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    bundle = load_hf_dir(tmp_path).tokenizer_bundle
    assert bundle.chat_template == "{{ 1 }}"
    assert bundle.special_tokens["eos_token"] == "<|im_end|>"
    assert bundle.eos_token_ids == (2, 0)
    (tmp_path / "chat_template.jinja").write_text("{{ 2 }}")
    assert load_hf_dir(tmp_path).tokenizer_bundle.chat_template == "{{ 2 }}"


def test_truncated_safetensors(tmp_path):
    save(build_tiny_random(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors: corrupted or truncated safetensors file"):
        load_hf_dir(tmp_path)


def test_corrupted_safetensors_header(tmp_path):
    save(build_tiny_random(), tmp_path)
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted or truncated safetensors file"):
        load_hf_dir(tmp_path)


def test_missing_shard(tmp_path):
    save(build_tiny_random(), tmp_path, max_shard_bytes=40_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-.*listed in"):
        load_hf_dir(tmp_path)


def test_missing_weight(tmp_path):
    save(build_tiny_random(), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors: lm_head.weight"):
        load_hf_dir(tmp_path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_hf_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_hf_dir(tmp_path)


def test_unsupported_architecture(tmp_path):
    save(build_tiny_random(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match="unsupported architecture 'gpt_neox'"):
        load_hf_dir(tmp_path)
