"""Which targets and settings `"method": "mtp"` serves (checked when the config is resolved, before anything
is loaded onto a device): a DeepSeek-V3 checkpoint with a multi-token prediction layer, on one device, its
weights unquantized, one decode step per iteration.

Qwen3-Next and Qwen3.5 checkpoints load their MTP module and `jaxserve.speculative.mtp_model` computes it,
but they are refused by name: they are Gated DeltaNet hybrids, and verifying drafts in one target step
advances each sequence's recurrent state over every drafted token; a rejected draft would leave it wrong
(serving them needs the state after each verified position kept and the accepted one chosen, as vLLM does)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpoints.config import ModelConfig

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

MTP_ARCHITECTURES = ("deepseek_v3",)
HYBRID_MTP_ARCHITECTURES = ("qwen3_next", "qwen3_5")  # MTP loaded and computed, not served (the docstring)


def check_mtp_target(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, naming what is missing or the settings refused, unless `config` asks for MTP speculation
    on a model and settings that serve it (nothing to check without it)."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return
    if model.architecture in HYBRID_MTP_ARCHITECTURES:
        raise ValueError(
            f'speculative method "mtp" is not served for {model.architecture} yet: it is a Gated DeltaNet hybrid, '
            "and verifying drafts would advance its recurrent state over rejected ones (no rollback yet)"
        )
    if model.architecture not in MTP_ARCHITECTURES:
        raise ValueError(
            f'speculative method "mtp" drafts with a DeepSeek-V3 checkpoint\'s multi-token prediction layer; this '
            f"model is {model.architecture}"
        )
    if model.num_nextn_predict_layers < 1:
        raise ValueError(
            'speculative method "mtp" needs the checkpoint\'s multi-token prediction layer, and this one has none '
            "(num_nextn_predict_layers = 0)"
        )
    refused = [
        name
        for name, on in (
            (f"tensor_parallel_size={config.tensor_parallel_size}", config.tensor_parallel_size > 1),
            (f"expert_parallel_size={config.expert_parallel_size}", config.expert_parallel_size > 1),
            (f"pipeline_parallel_size={config.pipeline_parallel_size}", config.pipeline_parallel_size > 1),
            (f"data_parallel_size={config.data_parallel_size}", config.data_parallel_size > 1),
            (f"quantization={config.quantization}", config.quantization != "none"),
            (f"num_scheduler_steps={config.num_scheduler_steps}", config.num_scheduler_steps > 1),
        )
        if on
    ]
    if refused:
        raise ValueError(f'speculative method "mtp" is not served with {", ".join(refused)} yet')
