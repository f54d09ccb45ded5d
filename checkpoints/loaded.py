"""What every loader returns."""

from __future__ import annotations

import dataclasses

from checkpoints.config import ModelConfig
from checkpoints.params import ParamTree
from checkpoints.tokenizer_bundle import TokenizerBundle


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    # Nested dicts of numpy arrays (see checkpoints.params); jax.Arrays when restored into shardings.
    params: ParamTree
    tokenizer_bundle: TokenizerBundle
