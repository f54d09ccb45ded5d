"""Gemma 3's vision tower: a SigLIP encoder and the multimodal projector (`Gemma3ForConditionalGeneration`).

The encoder cuts a square image into patches (a strided convolution: `patch_embed`, stored here as
a kernel [3 * patch * patch, hidden] over each patch's pixels in (channel, row, column) order), adds
a learned position embedding per patch, and runs pre-LayerNorm transformer layers (attention with
biases, a GELU-tanh MLP with biases), then a final LayerNorm. The projector average-pools the patch
grid down to `mm_tokens_per_image` soft tokens, RMS-normalises them (Gemma's `1 + w`, stored as
`1 + w` here like the text norms) and projects them to the language model's hidden size.

Hugging Face names are those of transformers 5's state dict (`model.vision_tower...`,
`model.multi_modal_projector...`, `model.language_model...`); `canonical_name` also reads the
Hub's older spelling (`vision_tower.vision_model...`, `language_model.model...`). The projection is
stored [in, out] there already (a parameter, not a linear layer). Gemma 3 drops SigLIP's pooling
head (`vision_use_head` false); a checkpoint with one is refused.

Parameter paths of the declaration (`[L, ...]`: stacked over the encoder's layers):

    patch_embed/kernel [3*P*P, C], patch_embed/bias [C], position_embed/embedding [N, C]
    layers/{attn_norm,mlp_norm}/{scale,bias} [L, C]
    layers/{q,k,v,o}_proj/{kernel [L, C, C], bias [L, C]}
    layers/fc1/{kernel [L, C, F], bias [L, F]}, layers/fc2/{kernel [L, F, C], bias [L, C]}
    post_norm/{scale,bias} [C]
    projector/norm/scale [C], projector/kernel [C, E]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from checkpoints.weights import BIAS, EMBEDDING, KERNEL, LAYERS, SCALE, Declaration, Weight

HF_TOWER = "model.vision_tower."
HF_LAYER = HF_TOWER + "encoder.layers.{layer}."
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
class VisionConfig:
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

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        side = round(self.mm_tokens_per_image**0.5)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square that divides "
                f"the {self.patches_per_side}x{self.patches_per_side} patch grid"
            )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def pool_kernel(self) -> int:
        """Patches per side pooled into one soft token."""
        return self.patches_per_side // round(self.mm_tokens_per_image**0.5)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def from_hf(hf: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """The vision tower of a `Gemma3ForConditionalGeneration` `config.json`."""
    v = hf["vision_config"]
    if v.get("vision_use_head", False):
        raise ValueError("a SigLIP pooling head (vision_use_head) is not part of Gemma 3's vision tower")
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"vision hidden_act {v['hidden_act']!r} is not supported")
    if v.get("num_channels", 3) != 3:
        raise ValueError("only 3-channel (RGB) vision towers are supported")
    return VisionConfig(
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"],
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
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
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_heads,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "layer_norm_eps": vision.layer_norm_eps,
            "hidden_act": "gelu_pytorch_tanh",
            "num_channels": 3,
            "vision_use_head": False,
        },
    }


def _layer(v: VisionConfig, shape: tuple[int, ...], init: str, hf: str) -> Weight:
    return Weight((v.num_layers, *shape), (LAYERS, *(None,) * len(shape)), init, hf=HF_LAYER + hf)


def _linear(v: VisionConfig, fan_in: int, fan_out: int, hf: str) -> dict[str, Weight]:
    return {
        "kernel": _layer(v, (fan_in, fan_out), KERNEL, hf + ".weight"),
        "bias": _layer(v, (fan_out,), BIAS, hf + ".bias"),
    }


def _layer_norm(v: VisionConfig, hf: str, stacked: bool = True) -> dict[str, Weight]:
    c = v.hidden_size
    if stacked:
        return {"scale": _layer(v, (c,), SCALE, hf + ".weight"), "bias": _layer(v, (c,), BIAS, hf + ".bias")}
    scale, bias = Weight((c,), (None,), SCALE, hf=hf + ".weight"), Weight((c,), (None,), BIAS, hf=hf + ".bias")
    return {"scale": scale, "bias": bias}


def weights(v: VisionConfig) -> Declaration:
    """The declared weights of a vision tower and its projector (replicated under any mesh)."""
    c, f, p = v.hidden_size, v.intermediate_size, 3 * v.patch_size**2
    embeddings = HF_TOWER + "embeddings."
    return {
        "patch_embed": {
            "kernel": Weight((p, c), (None, None), KERNEL, hf=embeddings + "patch_embedding.weight"),
            "bias": Weight((c,), (None,), BIAS, hf=embeddings + "patch_embedding.bias"),
        },
        "position_embed": {
            "embedding": Weight(
                (v.num_patches, c), (None, None), EMBEDDING, hf=embeddings + "position_embedding.weight"
            )
        },
        "layers": {
            "attn_norm": _layer_norm(v, "layer_norm1"),
            "q_proj": _linear(v, c, c, "self_attn.q_proj"),
            "k_proj": _linear(v, c, c, "self_attn.k_proj"),
            "v_proj": _linear(v, c, c, "self_attn.v_proj"),
            "o_proj": _linear(v, c, c, "self_attn.out_proj"),
            "mlp_norm": _layer_norm(v, "layer_norm2"),
            "fc1": _linear(v, c, f, "mlp.fc1"),
            "fc2": _linear(v, f, c, "mlp.fc2"),
        },
        "post_norm": _layer_norm(v, HF_TOWER + "post_layernorm", stacked=False),
        "projector": {
            "norm": {"scale": Weight((c,), (None,), SCALE, float32=True, hf=HF_PROJECTOR + "mm_soft_emb_norm.weight")},
            # A parameter stored [in, out] in the checkpoint, not a linear layer's [out, in].
            "kernel": Weight(
                (c, v.text_hidden_size), (None, None), KERNEL, hf=HF_PROJECTOR + "mm_input_projection_weight"
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
    if path == "patch_embed/kernel":  # a convolution [C, 3, P, P]: a kernel over each patch's pixels
        return array.reshape(array.shape[0], -1).T
    if path == "projector/norm/scale":
        return array + np.float32(1.0)
    if weight.is_kernel and path != "projector/kernel":  # the projection is stored [in, out] already
        return array.swapaxes(-1, -2)
    return array


def to_hf_tensor(path: str, weight: Weight, array: np.ndarray, v: VisionConfig) -> np.ndarray:
    """The inverse of `from_hf_tensor`."""
    if path == "patch_embed/kernel":
        return array.T.reshape(v.hidden_size, 3, v.patch_size, v.patch_size)
    if path == "projector/norm/scale":
        return array - np.float32(1.0)
    if weight.is_kernel and path != "projector/kernel":
        return array.swapaxes(-1, -2)
    return array
