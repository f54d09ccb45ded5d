"""The vision half of a Hugging Face vision-language directory (`Gemma3ForConditionalGeneration`).

`checkpoints.hf` reads and writes the language model as for a text model; this module says where
the text config and tensors sit inside a multimodal checkpoint (`text_config`,
`model.language_model.*`) and fills or writes the vision tower (`gemma3_vision`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoints.architectures import gemma3_vision
from checkpoints.config import ModelConfig
from checkpoints.loaded import VisionTower
from checkpoints.params import ParamFiller, checkpoint_names, iter_leaves
from checkpoints.weights import flat

MULTIMODAL_CLASS = "Gemma3ForConditionalGeneration"
MULTIMODAL_TYPE = "gemma3"  # its `model_type` (a text-only Gemma 3 is `gemma3_text`)
# transformers' `Gemma3TextConfig` defaults, which the Hub's multimodal configs leave out of `text_config`.
TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131072,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


def is_multimodal(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") == MULTIMODAL_TYPE and "vision_config" in hf


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's `config.json` fields of a multimodal one: its `text_config`, then the
    top level's ids and tying, then transformers' defaults."""
    text = {"model_type": "gemma3_text", **TEXT_DEFAULTS}
    text.update({k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf})
    return {**text, **hf["text_config"]}


def multimodal_config(text: dict[str, Any], vision: gemma3_vision.VisionConfig) -> dict[str, Any]:
    """A multimodal `config.json` from the language model's and the vision tower's."""
    return {
        "architectures": [MULTIMODAL_CLASS],
        "model_type": MULTIMODAL_TYPE,
        "text_config": {**text, "architectures": None},
        "tie_word_embeddings": text.get("tie_word_embeddings", True),
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        **gemma3_vision.to_hf(vision),
    }


class VisionFiller:
    """Fills a vision tower from checkpoint tensors, by their canonical names."""

    def __init__(self, config: ModelConfig, vision: gemma3_vision.VisionConfig, dtype: np.dtype, source: str):
        self.vision = vision
        self.weights = flat(gemma3_vision.weights(vision))
        self.filler = ParamFiller(config, dtype, source, lambda w: w.hf, self.weights)

    def put(self, name: str, array: np.ndarray) -> bool:
        """Fill the tensor `name` (canonical) if it is the vision tower's; False if it is not."""
        place = self.filler.place(name)
        if place is None:
            return False
        path = place[0]
        self.filler.put(name, gemma3_vision.from_hf_tensor(path, self.weights[path].unstacked(), array))
        return True

    def finish(self) -> VisionTower:
        return VisionTower(self.vision, self.filler.finish())


def vision_tensors(tower: VisionTower) -> dict[str, np.ndarray]:
    """The vision tower's tensors under their Hugging Face names, as stored."""
    leaves = dict(iter_leaves(tower.params))
    tensors: dict[str, np.ndarray] = {}
    for path, weight in flat(gemma3_vision.weights(tower.config)).items():
        value = np.asarray(leaves[path])
        for name, index in checkpoint_names(weight, weight.hf):
            part = gemma3_vision.to_hf_tensor(path, weight.unstacked(), value[index], tower.config)
            tensors[name] = np.ascontiguousarray(part)
    return tensors
