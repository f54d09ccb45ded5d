"""The SigLIP vision encoder that Gemma 3's and Idefics3 / SmolVLM's vision towers share.

The encoder cuts a square image into patches (a strided convolution: `patch_embed`, stored here as
a kernel [3 * patch * patch, hidden] over each patch's pixels in (channel, row, column) order), adds
a learned position embedding per patch, and runs pre-LayerNorm transformer layers (attention with
biases, a GELU-tanh MLP with biases), then a final LayerNorm. Each family adds its own projector
and names the tower's tensors under its own prefix.

Parameter paths of the declaration (`[L, ...]`: stacked over the encoder's layers):

    patch_embed/kernel [3*P*P, C], patch_embed/bias [C], position_embed/embedding [N, C]
    layers/{attn_norm,mlp_norm}/{scale,bias} [L, C]
    layers/{q,k,v,o}_proj/{kernel [L, C, C], bias [L, C]}
    layers/fc1/{kernel [L, C, F], bias [L, F]}, layers/fc2/{kernel [L, F, C], bias [L, C]}
    post_norm/{scale,bias} [C]
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from checkpoints.weights import BIAS, EMBEDDING, KERNEL, LAYERS, SCALE, Declaration, Weight


class EncoderShape(Protocol):
    """What the encoder's declaration needs of a vision tower's config."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    patch_size: int

    @property
    def num_patches(self) -> int: ...


class EncoderGeometry:
    """The patch grid of a square SigLIP encoder (a mixin of the families' frozen config dataclasses)."""

    image_size: int
    patch_size: int
    hidden_size: int
    num_heads: int

    def check_geometry(self) -> None:
        """ValueError for an image that is not a whole number of patches, or heads that do not divide."""
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def check_hf(v: dict[str, Any], family: str) -> None:
    """ValueError for a `vision_config` this encoder does not implement."""
    if v.get("vision_use_head", False):
        raise ValueError(f"a SigLIP pooling head (vision_use_head) is not part of {family}'s vision tower")
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"vision hidden_act {v['hidden_act']!r} is not supported")
    if v.get("num_channels", 3) != 3:
        raise ValueError("only 3-channel (RGB) vision towers are supported")


def fields_from_hf(v: dict[str, Any]) -> dict[str, Any]:
    """The encoder's `VisionConfig` fields from a `vision_config` (the inverse of `hf_fields`)."""
    return {
        "hidden_size": v["hidden_size"],
        "intermediate_size": v["intermediate_size"],
        "num_layers": v["num_hidden_layers"],
        "num_heads": v["num_attention_heads"],
        "image_size": v["image_size"],
        "patch_size": v["patch_size"],
        "layer_norm_eps": float(v.get("layer_norm_eps", 1e-6)),
    }


def hf_fields(v: Any) -> dict[str, Any]:
    """The encoder's fields of a `vision_config`."""
    return {
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_hidden_layers": v.num_layers,
        "num_attention_heads": v.num_heads,
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "layer_norm_eps": v.layer_norm_eps,
        "hidden_act": "gelu_pytorch_tanh",
        "num_channels": 3,
    }


def _layer(v: EncoderShape, shape: tuple[int, ...], init: str, hf: str) -> Weight:
    return Weight((v.num_layers, *shape), (LAYERS, *(None,) * len(shape)), init, hf=hf)


def _linear(v: EncoderShape, fan_in: int, fan_out: int, hf: str) -> dict[str, Weight]:
    return {
        "kernel": _layer(v, (fan_in, fan_out), KERNEL, hf + ".weight"),
        "bias": _layer(v, (fan_out,), BIAS, hf + ".bias"),
    }


def _layer_norm(v: EncoderShape, hf: str) -> dict[str, Weight]:
    return {
        "scale": _layer(v, (v.hidden_size,), SCALE, hf + ".weight"),
        "bias": _layer(v, (v.hidden_size,), BIAS, hf + ".bias"),
    }


def encoder_weights(v: EncoderShape, tower: str) -> Declaration:
    """The declared weights of the encoder whose tensors are named under `tower` (a prefix)."""
    c, f, p = v.hidden_size, v.intermediate_size, 3 * v.patch_size**2
    embeddings, layer = tower + "embeddings.", tower + "encoder.layers.{layer}."
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
            "attn_norm": _layer_norm(v, layer + "layer_norm1"),
            "q_proj": _linear(v, c, c, layer + "self_attn.q_proj"),
            "k_proj": _linear(v, c, c, layer + "self_attn.k_proj"),
            "v_proj": _linear(v, c, c, layer + "self_attn.v_proj"),
            "o_proj": _linear(v, c, c, layer + "self_attn.out_proj"),
            "mlp_norm": _layer_norm(v, layer + "layer_norm2"),
            "fc1": _linear(v, c, f, layer + "mlp.fc1"),
            "fc2": _linear(v, f, c, layer + "mlp.fc2"),
        },
        "post_norm": {
            "scale": Weight((c,), (None,), SCALE, hf=tower + "post_layernorm.weight"),
            "bias": Weight((c,), (None,), BIAS, hf=tower + "post_layernorm.bias"),
        },
    }


def from_hf_tensor(path: str, weight: Weight, array: np.ndarray) -> np.ndarray:
    """A checkpoint tensor of the encoder, or a linear projector's `[out, in]`, in the declared layout."""
    if path == "patch_embed/kernel":  # a convolution [C, 3, P, P]: a kernel over each patch's pixels
        return array.reshape(array.shape[0], -1).T
    return array.swapaxes(-1, -2) if weight.is_kernel else array


def to_hf_tensor(path: str, weight: Weight, array: np.ndarray, v: Any) -> np.ndarray:
    """The inverse of `from_hf_tensor`."""
    if path == "patch_embed/kernel":
        return array.T.reshape(v.hidden_size, 3, v.patch_size, v.patch_size)
    return array.swapaxes(-1, -2) if weight.is_kernel else array
