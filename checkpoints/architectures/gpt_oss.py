"""gpt-oss (OpenAI's open-weight MoE models, `GptOssForCausalLM`).

On the Llama layer it adds:

- attention: biases on q, k, v and o; an attention sink per query head (`self_attn.sinks`, a
  learned logit in each softmax's denominator with no value); sliding-window layers (128 tokens)
  alternating with full ones (`layer_types`); YaRN RoPE (factor 32 over 4,096 positions);
- a mixture of experts in every layer: a router with a bias, the top-k logits' softmax as the
  routing weights (the same as softmax, top-k, renormalise); experts with biases whose gate and
  up units are interleaved in one kernel `gate_up_proj` [X, E, 2F] (gate in the even columns, up
  in the odd) and `down_proj` [X, F, E], both stored [in, out] (not transposed as a Linear's
  weight), under a clamped SwiGLU (`jaxserve.model.experts.clamped_swiglu`).

Real checkpoints store the experts' kernels as MXFP4 blocks and scales (`quantization_config`
with `quant_method: mxfp4`); those are declared and loaded as stored (`experts_mxfp4`:
`expert_gate_up/blocks` [L, X, 2F, E / 32, 16] and `/scales` [L, X, 2F, E / 32], `expert_down/...`
likewise, out-major as in the file) and dequantized an expert at a time in the experts' matmuls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from checkpoints import mxfp4
from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf, rope
from checkpoints.config import ModelConfig
from checkpoints.weights import (
    BIAS,
    EMBED,
    EXPERT_FFW,
    EXPERTS,
    KERNEL,
    LAYERS,
    Q_HEADS,
    ROUTER,
    ROUTER_KERNEL,
    Declaration,
    Weight,
)

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 150_000.0
# transformers' defaults for a config without RoPE settings (those of the released models).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# The experts' kernels, which checkpoints store [in, out].
IN_OUT_KERNELS = ("layers/expert_gate_up/kernel", "layers/expert_down/kernel")
# transformers' own list of what its MXFP4 checkpoints leave unquantized.
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def _weight(config: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...], init: str, hf: str) -> Weight:
    """A per-layer weight stacked over the layers, named `hf` under a layer's prefix."""
    return Weight((config.num_layers, *shape), (LAYERS, *axes), init, hf=blocks.HF_LAYER + hf)


def expert_kernel(
    config: ModelConfig, shape: tuple[int, int, int], axes: tuple[str, str, str], hf: str
) -> dict[str, Weight]:
    """An expert kernel [X, in, out] named `hf`: as floats, or (`experts_mxfp4`) as its MXFP4
    blocks and scales, uint8 and out-major as stored (`hf`_blocks, `hf`_scales)."""
    if not config.experts_mxfp4:
        return {"kernel": _weight(config, shape, axes, KERNEL, hf)}
    experts, fan_in, fan_out = axes
    leaf_axes = {mxfp4.BLOCKS: (experts, fan_out, fan_in, None), mxfp4.SCALES: (experts, fan_out, fan_in)}
    return {
        leaf: dataclasses.replace(
            _weight(config, leaf_shape, leaf_axes[leaf], BIAS, f"{hf}_{leaf}"), storage="uint8"
        )  # random codes and scales are zeros
        for leaf, leaf_shape in mxfp4.shapes(shape).items()
    }


def moe(config: ModelConfig) -> Declaration:
    """The router and the experts, with their biases (expert_gate_up: gate and up interleaved)."""
    e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts
    return {
        "router": {
            "kernel": _weight(config, (e, x), (EMBED, ROUTER), ROUTER_KERNEL, "mlp.router.weight"),
            "bias": _weight(config, (x,), (ROUTER,), BIAS, "mlp.router.bias"),
        },
        "expert_gate_up": {
            **expert_kernel(config, (x, e, 2 * f), (EXPERTS, EMBED, EXPERT_FFW), "mlp.experts.gate_up_proj"),
            "bias": _weight(config, (x, 2 * f), (EXPERTS, EXPERT_FFW), BIAS, "mlp.experts.gate_up_proj_bias"),
        },
        "expert_down": {
            **expert_kernel(config, (x, f, e), (EXPERTS, EXPERT_FFW, EMBED), "mlp.experts.down_proj"),
            "bias": _weight(config, (x, e), (EXPERTS, EMBED), BIAS, "mlp.experts.down_proj_bias"),
        },
    }


def weights(config: ModelConfig) -> Declaration:
    sinks = _weight(config, (config.num_heads,), (Q_HEADS,), BIAS, "self_attn.sinks")
    declaration = blocks.decoder(config, blocks.llama_norms(config), moe(config))
    declaration["layers"]["sinks"] = {"logits": dataclasses.replace(sinks, float32=True)}  # f32, as the softmax
    return declaration


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling): `rope_parameters` (transformers 5), else `rope_theta` / `rope_scaling`,
    else transformers' defaults (YaRN, base 150,000)."""
    params = hf.get("rope_parameters")
    if params is not None:
        return rope({"rope_theta": hf.get("rope_theta", DEFAULT_THETA), **params}, hf)
    if hf.get("rope_scaling") is not None:
        return rope(None, hf, DEFAULT_THETA)
    return rope({"rope_theta": hf.get("rope_theta", DEFAULT_THETA), **DEFAULT_ROPE}, hf)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization not in (None, "mxfp4"):
        raise ValueError(f"gpt-oss with quantization_config quant_method={quantization!r} is not supported (mxfp4 is)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"gpt-oss with hidden_act {hf['hidden_act']!r} is not supported")
    theta, scaling = _rope(hf)
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    bias = bool(hf.get("attention_bias", True))
    return {
        **common_fields(hf, "gpt_oss"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "attention_sinks": True,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 131072)),
        "sliding_window": hf.get("sliding_window", 128),
        "layer_types": tuple(layer_types),
        "num_experts": hf["num_local_experts"],
        "num_experts_per_tok": hf.get("num_experts_per_tok") or hf.get("experts_per_token", 4),
        "moe_intermediate_size": hf["intermediate_size"],
        "norm_topk_prob": True,
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "experts_mxfp4": quantization == "mxfp4",
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    if config.attention_bias != config.attention_out_bias:
        raise ValueError("gpt-oss checkpoints have one attention_bias for q, k, v and o")
    d = common_hf(config, "GptOssForCausalLM")
    d.pop("use_sliding_window", None)
    return {
        **d,
        "model_type": "gpt_oss",
        "intermediate_size": config.moe_intermediate_size,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ()),
        "swiglu_limit": config.swiglu_limit,
        "swiglu_alpha": config.swiglu_alpha,
        **({"quantization_config": MXFP4_CONFIG} if config.experts_mxfp4 else {}),
    }


def with_mxfp4_experts(params: dict[str, Any]) -> dict[str, Any]:
    """Parameters of a float model with its experts' kernels replaced by their MXFP4 blocks and
    scales (`mxfp4.quantize`): those of the same config with `experts_mxfp4`."""
    layers = dict(params["layers"])
    for name in ("expert_gate_up", "expert_down"):
        leaves = dict(layers[name])
        leaves.update(mxfp4.quantize(leaves.pop("kernel")))
        layers[name] = leaves
    return {**params, "layers": layers}


def swap_in_out_kernels(path: str, array: np.ndarray) -> np.ndarray:
    """The experts' kernels [.., in, out] with their last axes swapped, which the loader and the
    writer swap again (they take every checkpoint kernel to be [.., out, in])."""
    return array.swapaxes(-1, -2) if path in IN_OUT_KERNELS else array


ARCHITECTURE = Architecture(
    "gpt_oss",
    "GptOssForCausalLM",
    weights,
    from_hf,
    to_hf,
    from_hf_tensor=swap_in_out_kernels,
    to_hf_tensor=swap_in_out_kernels,
)
