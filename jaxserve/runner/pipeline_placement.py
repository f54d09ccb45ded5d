"""What a runner changes for pipeline stages (`--pipeline-parallel-size`): the checks of what the
stages cannot run yet, the served model config (layers padded to whole stages, as
`sharding.pipeline` lays them out), its parameters in that layout, and the model's pipeline."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from jaxserve.config import EngineConfig
from jaxserve.model.attention import sliding_layers
from jaxserve.model.pipeline import PipelineLayers
from sharding.pipeline import PipelinePlan, pad_layers, plan_pipeline


def plan_stages(config: ModelConfig, engine_config: EngineConfig) -> PipelinePlan | None:
    """The stages of `config` (None without pipelining); ValueError for what they cannot run."""
    pp = engine_config.pipeline_parallel_size
    plan = plan_pipeline(config.num_layers, pp)
    if pp == 1:
        return None
    if engine_config.unroll_layers:
        raise ValueError("pipeline_parallel_size > 1 splits the stacked (scanned) layers; unroll_layers cannot be used")
    if config.num_experts:
        raise ValueError("pipeline_parallel_size > 1 does not run mixture-of-experts models yet (use ep / tp)")
    if len(set(sliding_layers(config))) > 1:
        raise ValueError(
            "pipeline_parallel_size > 1 does not run models with interleaved sliding-window and global layers yet"
        )
    return plan


def stage_model_config(config: ModelConfig, plan: PipelinePlan) -> ModelConfig:
    """The config the stages' model and cache are built with: `plan.padded_layers` layers."""
    types = config.layer_types and (config.layer_types[0],) * plan.padded_layers
    return dataclasses.replace(config, num_layers=plan.padded_layers, layer_types=types)


def model_layers_config(config: ModelConfig, plan: PipelinePlan) -> ModelConfig:
    """`stage_model_config` undone: the served config with the model's own layers."""
    types = config.layer_types and (config.layer_types[0],) * plan.num_layers
    return dataclasses.replace(config, num_layers=plan.num_layers, layer_types=types)


def stage_params(params: dict[str, Any], plan: PipelinePlan) -> dict[str, Any]:
    """The parameters with their stacked layers laid out in the plan's layer positions (`pad_layers`)."""
    return {**params, "layers": jax.tree.map(lambda leaf: pad_layers(leaf, plan), params["layers"])}


def pipeline_layers(mesh: Mesh, engine_config: EngineConfig) -> PipelineLayers:
    """The model's pipeline: decode and prefill rows in up to `pipeline_microbatches` micro-batches."""
    return PipelineLayers(mesh, engine_config.pipeline_microbatches or engine_config.pipeline_parallel_size)
