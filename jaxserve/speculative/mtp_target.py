"""Which targets and settings `"method": "mtp"` serves (checked when the config is resolved, before anything
is loaded onto a device): a DeepSeek-V3 checkpoint with a multi-token prediction layer, on one device, its
weights unquantized, one decode step per iteration."""

from __future__ import annotations

from typing import TYPE_CHECKING

from checkpoints.config import ModelConfig

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

MTP_ARCHITECTURES = ("deepseek_v3",)


def check_mtp_target(config: EngineConfig, model: ModelConfig) -> None:
    """ValueError, naming what is missing or the settings refused, unless `config` asks for MTP speculation
    on a model and settings that serve it (nothing to check without it)."""
    spec = config.speculative_config
    if spec is None or spec.method != "mtp":
        return
    if model.architecture not in MTP_ARCHITECTURES:
        raise ValueError(
            f'speculative method "mtp" drafts with a DeepSeek-V3 checkpoint\'s multi-token prediction layer; this '
            f"model is {model.architecture} (MTP of other architectures, e.g. Qwen3-Next/Qwen3.5, is not served yet)"
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
