"""Pipeline stages' layer split and the checks with clear errors (no devices needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from checkpoints.tiny_random import TINY_FAMILIES, tiny_random_config
from jaxserve.config import EngineConfig
from jaxserve.runner.pipeline_placement import plan_stages, stage_model_config
from sharding.mesh import make_mesh
from sharding.pipeline import pad_layers, plan_pipeline


def test_even_stages_are_contiguous_ranges():
    plan = plan_pipeline(30, 3)
    assert [plan.stage_layers(s) for s in range(3)] == [range(0, 10), range(10, 20), range(20, 30)]
    assert not plan.is_uneven and plan.padded_layers == 30
    assert plan.describe() == "pp=3: layers 0-9 | 10-19 | 20-29"


def test_uneven_stages_end_in_identity_layers():
    plan = plan_pipeline(30, 4)  # 8 + 8 + 7 + 7
    assert [len(plan.stage_layers(s)) for s in range(4)] == [8, 8, 7, 7]
    assert plan.padded_layers == 32 and plan.layers_per_stage == 8
    assert plan.describe() == "pp=4: layers 0-7 | 8-15 | 16-22 | 23-29 (2 identity layers)"
    index = plan.padded_index
    assert index[23] == -1 and index[31] == -1 and sorted(index[index >= 0]) == list(range(30))
    stacked = np.arange(30 * 2, dtype=np.float32).reshape(30, 2) + 1
    padded = pad_layers(stacked, plan)
    assert padded.shape == (32, 2) and not padded[23].any() and not padded[31].any()
    np.testing.assert_array_equal(padded[index >= 0], stacked)  # the real positions hold the layers in order


def test_every_stage_gets_a_layer_even_when_few_layers_are_left():
    plan = plan_pipeline(5, 4)  # 2 + 1 + 1 + 1, never an empty stage
    assert [len(plan.stage_layers(s)) for s in range(4)] == [2, 1, 1, 1]


@pytest.mark.parametrize(
    "pp, message",
    [
        (3, r"pipeline_parallel_size=3 is larger than the model's 2 layers: every stage needs at least one layer"),
        (0, r"pipeline_parallel_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_stage_counts_are_refused(pp, message):
    with pytest.raises(ValueError, match=message):
        plan_pipeline(2, pp)


def test_engine_config_checks_its_pipeline_settings():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_microbatches must be an integer >= 1"):
        EngineConfig(pipeline_parallel_size=2, pipeline_microbatches=0)


def test_a_mesh_that_does_not_fit_the_devices_is_refused():
    import jax

    with pytest.raises(ValueError, match=r"dp x tp = 2 x 2 x pp 4 = 16 devices requested, but only 1 are visible"):
        make_mesh(tensor_parallel_size=2, data_parallel_size=2, devices=jax.devices()[:1], pipeline_parallel_size=4)


@pytest.mark.parametrize(
    "family, settings, message",
    [
        ("llama", {"pipeline_parallel_size": 3}, "larger than the model's 2 layers"),
        ("mixtral", {"pipeline_parallel_size": 2}, "does not run mixture-of-experts models yet"),
        ("gemma3", {"pipeline_parallel_size": 3}, "interleaved sliding-window and global layers"),
        ("llama", {"pipeline_parallel_size": 2, "unroll_layers": True}, "unroll_layers cannot be used"),
    ],
)
def test_what_stages_cannot_run_is_refused(family, settings, message):
    config = tiny_random_config(**TINY_FAMILIES[family])
    with pytest.raises(ValueError, match=message):
        plan_stages(config, EngineConfig(**settings))


def test_uniform_sliding_layers_keep_their_kind_in_identity_layers():
    config = dataclasses.replace(
        tiny_random_config(num_layers=3, sliding_window=8), layer_types=("sliding_attention",) * 3
    )
    plan = plan_stages(config, EngineConfig(pipeline_parallel_size=2))
    served = stage_model_config(config, plan)
    assert served.num_layers == 4 and served.layer_types == ("sliding_attention",) * 4


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"enable_lora": True}, "enable_lora"),
        ({"quantization": "int8"}, "quantization"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"enable_lora": True, "kv_cache_dtype": "int8"}, "enable_lora, kv_cache_dtype"),
    ],
)
def test_stages_refuse_what_they_do_not_slice_yet(settings, named):
    with pytest.raises(ValueError, match=f"does not run with {named} yet"):
        EngineConfig(pipeline_parallel_size=2, **settings)
    EngineConfig(pipeline_parallel_size=1, **settings)  # one stage runs them
