"""Idefics3 / SmolVLM Hugging Face directories: the vision tower's config from `config.json` and
`preprocessor_config.json`, both spellings of the model type, and what is refused."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from checkpoints.errors import UnsupportedCheckpointError
from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.loaded import VisionTower
from checkpoints.tiny_smolvlm import build_tiny_smolvlm


@pytest.fixture(scope="module")
def model():
    return build_tiny_smolvlm()


def save(model, directory, **changes) -> None:
    vision = VisionTower(dataclasses.replace(model.vision.config, **changes), model.vision.params)
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory, vision=vision)


def test_an_idefics3_directory_round_trips(model, tmp_path):
    save(model, tmp_path, model_type="idefics3", do_image_splitting=False)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"] and config["scale_factor"] == 4
    loaded = load_hf_dir(tmp_path)
    assert loaded.vision.config == dataclasses.replace(
        model.vision.config, model_type="idefics3", do_image_splitting=False
    )
    for a, b in zip(jax.tree.leaves(loaded.vision.params), jax.tree.leaves(model.vision.params)):
        np.testing.assert_array_equal(a, b)


def test_processor_settings_default_to_four_tiles_a_side_with_splitting(model, tmp_path):
    save(model, tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    vision = load_hf_dir(tmp_path).vision.config
    assert (vision.longest_edge, vision.do_image_splitting) == (4 * 32, True)


def test_tiles_of_another_size_than_the_tower_are_refused(model, tmp_path):
    save(model, tmp_path)
    settings = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, "max_image_size": {"longest_edge": 64}}))
    with pytest.raises(UnsupportedCheckpointError, match="tiles of 64 pixels are not the vision tower's 32"):
        load_hf_dir(tmp_path)
