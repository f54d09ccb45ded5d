"""Gemma 3's vision tower against transformers (tests/data/vlm_reference.json): the image
preprocessing, the SigLIP encoder and projector, and the multimodal Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from checkpoints.hf import load_hf_dir, save_hf_dir
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
