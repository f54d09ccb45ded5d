"""Gemma 3's vision tower against transformers (tests/data/vlm_reference.json): the image
preprocessing, the SigLIP encoder and projector, and the multimodal Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from checkpoints.architectures import config_from_hf
from checkpoints.architectures.gemma3_vision import canonical_name
from checkpoints.architectures.gemma3_vision import from_hf as vision_from_hf
from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.hf_vision import text_config
from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.images import ImageError, load_image
from jaxserve.model.vision import image_embeddings
from tests.data.vlm_images import SIZES, image_png

REFERENCE = json.loads((Path(__file__).parent / "data" / "vlm_reference.json").read_text())


@pytest.fixture(scope="module")
def model():
    return build_tiny_vlm()


@pytest.mark.parametrize("name", sorted(SIZES))
def test_preprocessing_equals_transformers(model, name):
    image = load_image(image_png(name), model.vision.config.image_size, 10**6)
    want = REFERENCE["pixels"][name]
    assert image.pixels.shape == (3, 32, 32)
    np.testing.assert_allclose(image.pixels[:, :2, :2], want["corner"], atol=1e-6)
    assert abs(float(image.pixels.mean()) - want["mean"]) < 1e-6


@pytest.mark.parametrize("name", sorted(SIZES))
def test_soft_tokens_equal_transformers(model, name):
    pixels = load_image(image_png(name), model.vision.config.image_size, 10**6).pixels
    encode = jax.jit(image_embeddings, static_argnums=0)
    out = np.asarray(encode(model.vision.config, model.vision.params, pixels[None]))
    want = REFERENCE["image_embeddings"][name]
    assert out.shape == (1, 16, 64)
    np.testing.assert_allclose(out[0, 0, :8], want["first"], atol=2e-5)
    assert abs(float(out.sum()) - want["sum"]) < 1e-3


def test_digest_is_of_the_pixels(model):
    size = model.vision.config.image_size
    a, b = load_image(image_png("red"), size, 10**6), load_image(image_png("blue"), size, 10**6)
    assert a.digest == load_image(image_png("red"), size, 10**6).digest != b.digest


@pytest.mark.parametrize(
    "data, message",
    [(b"not an image at all", "not a readable image"), (image_png("blue")[:200], "not a readable image")],
)
def test_bad_images_are_refused(data, message):
    with pytest.raises(ImageError, match=message):
        load_image(data, 32, 10**6)


def test_too_many_pixels_are_refused():
    with pytest.raises(ImageError, match="64x64 pixels; at most 1000"):
        load_image(image_png("blue"), 32, 1000)


def test_multimodal_directory_round_trip(model, tmp_path):
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, tmp_path, vision=model.vision)
    loaded = load_hf_dir(tmp_path)
    assert loaded.config == model.config and loaded.vision.config == model.vision.config
    for a, b in zip(jax.tree.leaves(loaded.vision.params), jax.tree.leaves(model.vision.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(a, b)


def test_the_hub_config_of_gemma_3_4b_reads_with_transformers_defaults():
    hub = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    text = config_from_hf(text_config(hub))
    assert (text.num_heads, text.num_kv_heads, text.head_dim, text.vocab_size) == (8, 4, 256, 262208)
    assert text.eos_token_ids == (1, 106) and text.tie_word_embeddings and text.rope_theta == 1e6
    vision = vision_from_hf(hub, text.hidden_size)
    assert (vision.patches_per_side, vision.pool_kernel, vision.image_token_id) == (64, 4, 262144)


def test_hub_tensor_names_are_read_as_transformers_5_names():
    assert canonical_name("vision_tower.vision_model.encoder.layers.3.mlp.fc1.weight") == (
        "model.vision_tower.encoder.layers.3.mlp.fc1.weight"
    )
    assert canonical_name("language_model.model.layers.0.mlp.up_proj.weight") == (
        "model.language_model.layers.0.mlp.up_proj.weight"
    )
    assert canonical_name("multi_modal_projector.mm_soft_emb_norm.weight") == (
        "model.multi_modal_projector.mm_soft_emb_norm.weight"
    )
    assert canonical_name("model.vision_tower.post_layernorm.bias") == "model.vision_tower.post_layernorm.bias"
