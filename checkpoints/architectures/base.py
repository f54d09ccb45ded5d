"""What an architecture is: its weights, its configuration in each checkpoint format, and the
few tensor conventions of its checkpoints that differ from ours.

Each family is a small module of this package that builds one `Architecture` from the shared
pieces in `blocks.py` (weights) and `hf_config.py` / `gguf_config.py` (configuration), and the
package's `ARCHITECTURES` lists it: adding a family is a module and a line there. The model's
forward pass (`jaxserve/model/`) reads the configuration's switches (q/k norms, post norms,
sliding layers, experts, ...), and takes its parameter shapes from the declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from checkpoints.config import ModelConfig
from checkpoints.weights import Declaration

# (declared parameter path, tensor as read) -> tensor in our convention (or the inverse).
TensorHook = Callable[[str, np.ndarray], np.ndarray]


def unchanged(path: str, array: np.ndarray) -> np.ndarray:
    return array


def unchanged_gguf(path: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    return array


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family.

    name: `ModelConfig.architecture`, and the `model_type` of its Hugging Face configs.
    hf_class: the `architectures` entry of its `config.json`.
    weights: the declaration of a config's parameters (`checkpoints.weights`).
    from_hf: the ModelConfig fields of a `config.json` (see `hf_config.common_fields`).
    to_hf: the `config.json` fields of a ModelConfig, those `from_hf` reads back.
    from_gguf: ModelConfig fields of its GGUF metadata beyond the shared ones (`gguf_config`):
      (metadata, GGUF architecture name, tensor names) -> fields; None: not loaded from GGUF.
    gguf_name: its `general.architecture` in GGUF files.
    from_hf_tensor / to_hf_tensor: a Hugging Face tensor into our convention, and back (Gemma
      stores its norm scales minus one).
    from_gguf_tensor: a GGUF tensor into our convention, given the config (llama.cpp permutes
      Llama's Q/K rows).
    chat_template: used when a checkpoint of this family carries none (a base model's GGUF);
      `end_of_turn` is the token that closes its turns (a stop token wherever it is used).
    hf_model_type: the `model_type` of its `config.json`, where it is not `name`.
    """

    name: str
    hf_class: str
    weights: Callable[[ModelConfig], Declaration]
    from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    from_gguf: Callable[[dict[str, Any], str, set[str]], dict[str, Any]] | None = None
    gguf_name: str | None = None
    from_hf_tensor: TensorHook = unchanged
    to_hf_tensor: TensorHook = unchanged
    from_gguf_tensor: Callable[[str, np.ndarray, ModelConfig], np.ndarray] = unchanged_gguf
    chat_template: str | None = None
    end_of_turn: str | None = None
    hf_model_type: str | None = None

    @property
    def model_type(self) -> str:
        return self.hf_model_type or self.name
