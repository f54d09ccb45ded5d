"""RoPE scaling: YaRN against Hugging Face's numbers, and its attention factor in the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve.model.rope import attention_factor, inverse_frequencies, rope_cos_sin

REFERENCE = json.loads((Path(__file__).parent / "data" / "yarn_reference.json").read_text())["cases"]


@pytest.mark.parametrize("case", REFERENCE, ids=[json.dumps(c["rope_scaling"]) for c in REFERENCE])
def test_yarn_matches_hugging_face(case):
    config = dataclasses.replace(
        build_tiny_random().config,
        head_dim=case["head_dim"],
        rope_theta=case["rope_theta"],
        max_position_embeddings=case["max_position_embeddings"],
        rope_scaling=case["rope_scaling"],
    )
    np.testing.assert_allclose(inverse_frequencies(config), case["inv_freq"], rtol=1e-6)
    assert attention_factor(config) == pytest.approx(case["attention_factor"], rel=1e-12)


def test_only_yarn_scales_cos_and_sin():
    config = build_tiny_random().config
    assert attention_factor(config) == 1.0
    assert attention_factor(dataclasses.replace(config, rope_scaling={"rope_type": "linear", "factor": 2.0})) == 1.0
    positions = jnp.arange(5)
    inv_freq = inverse_frequencies(config)
    cos, sin = rope_cos_sin(positions, inv_freq)
    scaled_cos, scaled_sin = rope_cos_sin(positions, inv_freq, 1.5)
    np.testing.assert_allclose(scaled_cos, 1.5 * cos, rtol=1e-6)
    np.testing.assert_allclose(scaled_sin, 1.5 * sin, rtol=1e-6)


def test_the_model_applies_the_yarn_attention_factor():
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    def first_logprobs(scaling: dict) -> np.ndarray:
        model = build_tiny_random()
        model.config = dataclasses.replace(model.config, rope_scaling=scaling)
        engine = LLMEngine(
            model,
            EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=8, num_blocks=32),
        )
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        (delta,) = [d for d in deltas if d.logprobs]
        return np.array([lp for _, lp in delta.logprobs[0].top])

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert not np.allclose(first_logprobs(yarn), first_logprobs({**yarn, "attention_factor": 1.0}), atol=1e-4)
