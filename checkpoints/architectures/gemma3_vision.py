"""Gemma 3's vision tower: a SigLIP encoder and the multimodal projector (`Gemma3ForConditionalGeneration`).

The encoder is `siglip`'s. The projector average-pools the patch grid down to `mm_tokens_per_image`
soft tokens, RMS-normalises them (Gemma's `1 + w`, stored as `1 + w` here like the text norms) and
projects them to the language model's hidden size. Every soft token of an image attends to every
other one in the language model (`bidirectional_images`).

Hugging Face names are those of transformers 5's state dict (`model.vision_tower...`,
`model.multi_modal_projector...`, `model.language_model...`); `canonical_name` also reads the
Hub's older spelling (`vision_tower.vision_model...`, `language_model.model...`). The projection is
stored [in, out] there already (a parameter, not a linear layer). Gemma 3 drops SigLIP's pooling
head (`vision_use_head` false); a checkpoint with one is refused.

Parameter paths of the declaration: `siglip`'s, and

    projector/norm/scale [C], projector/kernel [C, E]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from checkpoints.architectures import siglip
from checkpoints.weights import KERNEL, SCALE, Declaration, Weight

FAMILY = "gemma3"
HF_TOWER = "model.vision_tower."
HF_PROJECTOR = "model.multi_modal_projector."
HF_TEXT = "model.language_model."
# The Hub's spelling of a Gemma 3 checkpoint -> transformers 5's (the names declared here).
_HUB_PREFIXES = (
    ("language_model.model.", HF_TEXT),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.vision_model.", HF_TOWER),
    ("vision_tower.", HF_TOWER),
    ("multi_modal_projector.", HF_PROJECTOR),
)


@dataclasses.dataclass(frozen=True)
class VisionConfig(siglip.EncoderGeometry):
    """The vision tower of a Gemma 3 checkpoint (`vision_config` and the top-level image fields)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int
    boi_token_id: int  # <start_of_image>: the prompt's placeholder of an image
    eoi_token_id: int  # <end_of_image>
    image_token_id: int  # <image_soft_token>: a row the projector's output fills

    family = FAMILY
    bidirectional_images = True  # an image's rows attend to each other both ways

    def __post_init__(self) -> None:
        self.check_geometry()
        side = round(self.mm_tokens_per_image**0.5)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square that divides "
                f"the {self.patches_per_side}x{self.patches_per_side} patch grid"
            )

    @property
    def placeholder_token_id(self) -> int:
        """The token a rendered chat holds where an image goes."""
        return self.boi_token_id

    @property
    def pool_kernel(self) -> int:
        """Patches per side pooled into one soft token."""
        return self.patches_per_side // round(self.mm_tokens_per_image**0.5)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def from_hf(hf: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """The vision tower of a `Gemma3ForConditionalGeneration` `config.json`."""
    v = hf["vision_config"]
    siglip.check_hf(v, "Gemma 3")
    return VisionConfig(
        **siglip.fields_from_hf(v),
        mm_tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
        text_hidden_size=text_hidden_size,
        boi_token_id=int(hf.get("boi_token_index", 255999)),
        eoi_token_id=int(hf.get("eoi_token_index", 256000)),
        image_token_id=int(hf.get("image_token_index", 262144)),
    )


def to_hf(vision: VisionConfig) -> dict[str, Any]:
    """The top-level image fields and `vision_config` of a `config.json`."""
    return {
        "mm_tokens_per_image": vision.mm_tokens_per_image,
        "boi_token_index": vision.boi_token_id,
        "eoi_token_index": vision.eoi_token_id,
        "image_token_index": vision.image_token_id,
        "vision_config": {"model_type": "siglip_vision_model", **siglip.hf_fields(vision), "vision_use_head": False},
    }


def weights(v: VisionConfig) -> Declaration:
    """The declared weights of a vision tower and its projector (replicated under any mesh)."""
    return {
        **siglip.encoder_weights(v, HF_TOWER),
        "projector": {
            "norm": {
                "scale": Weight(
                    (v.hidden_size,), (None,), SCALE, float32=True, hf=HF_PROJECTOR + "mm_soft_emb_norm.weight"
                )
            },
            # A parameter stored [in, out] in the checkpoint, not a linear layer's [out, in].
            "kernel": Weight(
                (v.hidden_size, v.text_hidden_size),
                (None, None),
                KERNEL,
                hf=HF_PROJECTOR + "mm_input_projection_weight",
            ),
        },
    }


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as declared (transformers 5's spelling)."""
    for hub, ours in _HUB_PREFIXES:
        if name.startswith(hub) and not name.startswith(ours):
            return ours + name[len(hub) :]
    return name


def text_name(hf: str) -> str:
    """The name of a Gemma 3 text weight (`model.layers...`) inside the multimodal checkpoint."""
    return HF_TEXT + hf[len("model.") :] if hf.startswith("model.") else hf


def from_hf_tensor(path: str, weight: Weight, array: np.ndarray) -> np.ndarray:
    """A checkpoint tensor (as stored) in the declared layout."""
    if path == "projector/norm/scale":
        return array + np.float32(1.0)
    if path == "projector/kernel":  # the projection is stored [in, out] already
        return array
    return siglip.from_hf_tensor(path, weight, array)


def to_hf_tensor(path: str, weight: Weight, array: np.ndarray, v: VisionConfig) -> np.ndarray:
    """The inverse of `from_hf_tensor`."""
    if path == "projector/norm/scale":
        return array - np.float32(1.0)
    if path == "projector/kernel":
        return array
    return siglip.to_hf_tensor(path, weight, array, v)
