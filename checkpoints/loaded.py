"""What every loader returns."""

from __future__ import annotations

import dataclasses

from checkpoints.architectures import gemma3_vision, idefics3_vision
from checkpoints.config import ModelConfig
from checkpoints.params import ParamTree
from checkpoints.tokenizer_bundle import TokenizerBundle


@dataclasses.dataclass
class VisionTower:
    """A vision-language model's image encoder and projector (`checkpoints.architectures.gemma3_vision`,
    `idefics3_vision`)."""

    config: gemma3_vision.VisionConfig | idefics3_vision.VisionConfig
    params: ParamTree  # the declaration's tree (the family's `weights`), numpy arrays


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    # Nested dicts of numpy arrays (see checkpoints.params); jax.Arrays when restored into shardings.
    params: ParamTree
    tokenizer_bundle: TokenizerBundle
    vision: VisionTower | None = None  # a vision-language model's vision tower (None: text only)
