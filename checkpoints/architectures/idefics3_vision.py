"""Idefics3 / SmolVLM's vision tower: a SigLIP encoder and the connector
(`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`).

The encoder is `siglip`'s. The connector pixel-shuffles the patch grid (each `scale_factor` x
`scale_factor` block of neighbouring patches becomes one token of `scale_factor**2` times the
width) and projects it to the language model's hidden size with one linear layer without bias
(`modality_projection`). An image tile gives `image_seq_len` tokens; the language model (Llama)
attends to them causally like text. The image processor's settings (`preprocessor_config.json`:
the longest edge an image is resized to, whether it is split into tiles) are kept here too, as
they decide how many tiles, and so how many tokens, an image takes.

Hugging Face names: `model.vision_model...`, `model.connector.modality_projection.proj.weight`,
`model.text_model...` (the Llama model's `model.` prefix) and `lm_head.weight`.

Parameter paths of the declaration: `siglip`'s, and `projector/kernel [C * scale_factor**2, E]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from checkpoints.architectures import siglip
from checkpoints.weights import KERNEL, Declaration, Weight

FAMILY = "idefics3"
CLASSES = {"idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration"}
HF_TOWER = "model.vision_model."
HF_PROJECTION = "model.connector.modality_projection.proj.weight"
HF_TEXT = "model.text_model."


@dataclasses.dataclass(frozen=True)
class VisionConfig(siglip.EncoderGeometry):
    """The vision tower of an Idefics3 / SmolVLM checkpoint and its image processor's settings."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # also the processor's `max_image_size`: the side of a tile
    patch_size: int
    layer_norm_eps: float
    scale_factor: int
    text_hidden_size: int
    image_token_id: int  # <image>: the prompt's placeholder of an image, and each row of a tile
    model_type: str = "smolvlm"  # or "idefics3": the config's spelling
    longest_edge: int = 4 * 364  # the processor's `size`: an image's longest edge before it is split
    do_image_splitting: bool = True

    family = FAMILY
    bidirectional_images = False  # the Llama model attends to image rows causally

    def __post_init__(self) -> None:
        self.check_geometry()
        if self.patches_per_side % self.scale_factor:
            raise ValueError(f"scale_factor {self.scale_factor} does not divide the {self.patches_per_side} patch grid")
        if self.model_type not in CLASSES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {sorted(CLASSES)}")

    @property
    def placeholder_token_id(self) -> int:
        """The token a rendered chat holds where an image goes."""
        return self.image_token_id

    @property
    def mm_tokens_per_image(self) -> int:
        """Tokens of one tile (the processor's `image_seq_len`)."""
        return self.num_patches // self.scale_factor**2


def from_hf(hf: dict[str, Any], text_hidden_size: int, processor: dict[str, Any]) -> VisionConfig:
    """The vision tower of a `config.json` and its `preprocessor_config.json` (`processor`, {} if none)."""
    v = hf["vision_config"]
    siglip.check_hf(v, "Idefics3")
    tile = processor.get("max_image_size", {}).get("longest_edge", v["image_size"])
    if tile != v["image_size"]:
        raise ValueError(f"the processor's tiles of {tile} pixels are not the vision tower's {v['image_size']}")
    return VisionConfig(
        **siglip.fields_from_hf(v),
        scale_factor=int(hf.get("scale_factor", 2)),
        text_hidden_size=text_hidden_size,
        image_token_id=int(hf.get("image_token_id", 128257)),
        model_type=hf["model_type"],
        longest_edge=int(processor.get("size", {}).get("longest_edge", 4 * v["image_size"])),
        do_image_splitting=bool(processor.get("do_image_splitting", True)),
    )


def to_hf(vision: VisionConfig) -> dict[str, Any]:
    """The top-level image fields and `vision_config` of a `config.json`."""
    return {
        "scale_factor": vision.scale_factor,
        "image_token_id": vision.image_token_id,
        "vision_config": {"model_type": f"{vision.model_type}_vision", **siglip.hf_fields(vision)},
    }


def processor_config(vision: VisionConfig) -> dict[str, Any]:
    """The image processor's `preprocessor_config.json` (PIL backend, Lanczos, mean and std 0.5)."""
    name = {"smolvlm": "SmolVLMImageProcessor", "idefics3": "Idefics3ImageProcessor"}[vision.model_type]
    return {
        "image_processor_type": name,
        "do_resize": True,
        "size": {"longest_edge": vision.longest_edge},
        "max_image_size": {"longest_edge": vision.image_size},
        "do_image_splitting": vision.do_image_splitting,
        "resample": 1,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pad": True,
    }


def weights(v: VisionConfig) -> Declaration:
    """The declared weights of a vision tower and its connector (replicated under any mesh)."""
    width = v.hidden_size * v.scale_factor**2
    kernel = Weight((width, v.text_hidden_size), (None, None), KERNEL, hf=HF_PROJECTION)
    return {**siglip.encoder_weights(v, HF_TOWER), "projector": {"kernel": kernel}}


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as declared (the Hub's and transformers 5's spelling are one)."""
    return name


def text_name(hf: str) -> str:
    """The name of a Llama text weight (`model.layers...`) inside the multimodal checkpoint."""
    return HF_TEXT + hf[len("model.") :] if hf.startswith("model.") else hf


def from_hf_tensor(path: str, weight: Weight, array: np.ndarray) -> np.ndarray:
    """A checkpoint tensor (as stored) in the declared layout."""
    return siglip.from_hf_tensor(path, weight, array)


def to_hf_tensor(path: str, weight: Weight, array: np.ndarray, v: VisionConfig) -> np.ndarray:
    """The inverse of `from_hf_tensor`."""
    return siglip.to_hf_tensor(path, weight, array, v)
