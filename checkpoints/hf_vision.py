"""The vision half of a Hugging Face vision-language directory (`Gemma3ForConditionalGeneration`,
`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`).

`checkpoints.hf` reads and writes the language model as for a text model; this module says where
the text config and tensors sit inside a multimodal checkpoint (`text_config`,
`model.language_model.*` / `model.text_model.*`) and fills or writes the vision tower
(`gemma3_vision`, `idefics3_vision`: a family module each, picked by the config's `model_type`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from checkpoints.architectures import gemma3_vision, idefics3_vision
from checkpoints.config import ModelConfig
from checkpoints.loaded import VisionTower
from checkpoints.params import ParamFiller, checkpoint_names, iter_leaves
from checkpoints.weights import flat

GEMMA3_CLASS = "Gemma3ForConditionalGeneration"
PROCESSOR_FILE = "preprocessor_config.json"  # an Idefics3 / SmolVLM image processor's settings
# transformers' `Gemma3TextConfig` defaults, which the Hub's multimodal configs leave out of `text_config`.
GEMMA3_TEXT_DEFAULTS = {
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
# A multimodal config's `model_type` -> its vision family (a text-only Gemma 3 is `gemma3_text`).
_FAMILIES = {"gemma3": gemma3_vision, "idefics3": idefics3_vision, "smolvlm": idefics3_vision}
_BY_NAME = {gemma3_vision.FAMILY: gemma3_vision, idefics3_vision.FAMILY: idefics3_vision}


def is_multimodal(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in _FAMILIES and "vision_config" in hf


def family(vision: Any) -> ModuleType:
    """The family module of a vision tower's config (`gemma3_vision` or `idefics3_vision`)."""
    return _BY_NAME[vision.family]


def vision_to_json(vision: Any) -> str:
    """A vision tower's config as a JSON object: its fields and its "family" (`vision_from_json`)."""
    return json.dumps({"family": vision.family, **dataclasses.asdict(vision)})


def vision_from_json(text: str) -> Any:
    """The config `vision_to_json` wrote (ValueError for one it did not)."""
    try:
        fields = json.loads(text)
        return _BY_NAME[fields.pop("family")].VisionConfig(**fields)
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"not a vision config: {e!r}") from None


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's `config.json` fields of a multimodal one: its `text_config`, then the
    top level's ids and tying, then (Gemma 3) transformers' defaults."""
    if hf["model_type"] == "gemma3":
        text = {"model_type": "gemma3_text", **GEMMA3_TEXT_DEFAULTS}
    else:
        text = {"model_type": "llama"}
    text.update({k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf})
    return {**text, **hf["text_config"]}


def vision_config(hf: dict[str, Any], text_hidden_size: int, directory: Path) -> Any:
    """The vision tower's config of a multimodal `config.json` in `directory`."""
    if hf["model_type"] == "gemma3":
        return gemma3_vision.from_hf(hf, text_hidden_size)
    processor = directory / PROCESSOR_FILE
    settings = json.loads(processor.read_text(encoding="utf-8")) if processor.is_file() else {}
    return idefics3_vision.from_hf(hf, text_hidden_size, settings)


def multimodal_config(text: dict[str, Any], vision: Any) -> dict[str, Any]:
    """A multimodal `config.json` from the language model's and the vision tower's."""
    if vision.family == gemma3_vision.FAMILY:
        cls, model_type = GEMMA3_CLASS, "gemma3"
    else:
        cls, model_type = idefics3_vision.CLASSES[vision.model_type], vision.model_type
    return {
        "architectures": [cls],
        "model_type": model_type,
        "text_config": {**text, "architectures": None},
        "tie_word_embeddings": text.get("tie_word_embeddings", True),
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        **family(vision).to_hf(vision),
    }


def write_processor(vision: Any, directory: Path) -> None:
    """An Idefics3 / SmolVLM tower's `preprocessor_config.json` (Gemma 3's needs none here)."""
    if vision.family == idefics3_vision.FAMILY:
        text = json.dumps(idefics3_vision.processor_config(vision), indent=2)
        (directory / PROCESSOR_FILE).write_text(text, encoding="utf-8")


class VisionFiller:
    """Fills a vision tower from checkpoint tensors, by their canonical names."""

    def __init__(self, config: ModelConfig, vision: Any, dtype: np.dtype, source: str):
        self.vision, self.family = vision, family(vision)
        self.weights = flat(self.family.weights(vision))
        self.filler = ParamFiller(config, dtype, source, lambda w: w.hf, self.weights)

    def put(self, name: str, array: np.ndarray) -> bool:
        """Fill the tensor `name` (canonical) if it is the vision tower's; False if it is not."""
        place = self.filler.place(name)
        if place is None:
            return False
        path = place[0]
        self.filler.put(name, self.family.from_hf_tensor(path, self.weights[path].unstacked(), array))
        return True

    def finish(self) -> VisionTower:
        return VisionTower(self.vision, self.filler.finish())


def vision_tensors(tower: VisionTower) -> dict[str, np.ndarray]:
    """The vision tower's tensors under their Hugging Face names, as stored."""
    module = family(tower.config)
    leaves = dict(iter_leaves(tower.params))
    tensors: dict[str, np.ndarray] = {}
    for path, weight in flat(module.weights(tower.config)).items():
        value = np.asarray(leaves[path])
        for name, index in checkpoint_names(weight, weight.hf):
            part = module.to_hf_tensor(path, weight.unstacked(), value[index], tower.config)
            tensors[name] = np.ascontiguousarray(part)
    return tensors
