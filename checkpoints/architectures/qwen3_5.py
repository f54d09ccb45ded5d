"""Qwen3.5 (text, `Qwen3_5ForCausalLM`): a Gated DeltaNet hybrid. Three of every four layers are
Gated DeltaNet layers (linear attention: a causal depthwise conv and a recurrent state per
sequence), the fourth gated full attention (q_proj doubled: per head its queries then a sigmoid
gate on its output; q/k norms; RoPE on the first quarter of each head). Dense SwiGLU MLPs.

The norms of the layers, of q and k, and the final one multiply by (1 + weight) (zero-centered):
Hugging Face checkpoints store the weight, we keep 1 + weight (as for Gemma), so every norm is
the same block. The Gated DeltaNet's own output norm (gated by z) multiplies by its weight as is.

Parameters (two layer groups, `layer_groups.py`): `linear_layers/` [L_linear, ...]:
attn_norm, in_proj_{qkv,z,b,a}/kernel, gated_delta/{conv1d, A_log, dt_bias}, linear_norm,
out_proj/kernel, mlp_norm, MLP; `layers/` [L_full, ...]: attn_norm, q_proj [E, 2 H D], k/v/o_proj,
q_norm, k_norm, mlp_norm, MLP.

The multi-token prediction (MTP) module, when the config counts its layers (`mtp_num_hidden_layers`,
Qwen3.5's name; `num_nextn_predict_layers`, the name vLLM reads for Qwen3-Next), is declared under `mtp/`
and loaded (the forward pass ignores it; `jaxserve/speculative/mtp_model.py` runs it): `mtp.fc` [2E -> E]
(`eh_proj`) over the normed embedding then the normed hidden state (`mtp.pre_fc_norm_embedding`, `enorm`;
`mtp.pre_fc_norm_hidden`, `hnorm`), `mtp.layers.{i}` (gated full-attention layers with the model's MLP,
`layer/` [n, ...]) and `mtp.norm` (`head_norm`). It shares the model's embedding and head (no copies stored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.hf_config import common_fields, common_hf
from checkpoints.architectures.layer_groups import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    LayerGroup,
    group_config,
    layer_groups,
)
from checkpoints.config import ModelConfig
from checkpoints.weights import (
    BIAS,
    CONV,
    EMBED,
    KERNEL,
    KV_HEADS,
    LAYERS,
    LINEAR_HEADS,
    Q_HEADS,
    SCALE,
    Declaration,
    Weight,
    flat,
    nest,
)

LINEAR_PREFIX = "model.layers.{layer}.linear_attn."
CONV_PATH = "linear_layers/gated_delta/conv1d"


def gated_attention(config: ModelConfig) -> Declaration:
    """q (doubled: queries and their output gate), k, v, o projections and the q/k norms."""
    e, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    bias = config.attention_bias
    return {
        "q_proj": blocks.linear(config, e, 2 * q, (EMBED, Q_HEADS), "self_attn.q_proj", "attn_q", bias),
        "k_proj": blocks.linear(config, e, kv, (EMBED, KV_HEADS), "self_attn.k_proj", "attn_k", bias),
        "v_proj": blocks.linear(config, e, kv, (EMBED, KV_HEADS), "self_attn.v_proj", "attn_v", bias),
        "o_proj": blocks.linear(config, q, e, (Q_HEADS, EMBED), "self_attn.o_proj", "attn_output"),
        "q_norm": blocks.norm(config, "self_attn.q_norm", "attn_q_norm", d),
        "k_norm": blocks.norm(config, "self_attn.k_norm", "attn_k_norm", d),
    }


def _per_head(config: ModelConfig, shape: tuple[int, ...], init: str, hf: str, float32: bool = False) -> Weight:
    """A stacked Gated DeltaNet parameter whose first axis is over its heads (split like them)."""
    axes = (LAYERS, LINEAR_HEADS) + (None,) * (len(shape) - 1)
    return Weight((config.num_layers, *shape), axes, init, float32=float32, hf=LINEAR_PREFIX + hf)


def gated_deltanet(config: ModelConfig) -> Declaration:
    """The Gated DeltaNet block: input projections, the conv's taps, the decay's A_log and dt_bias,
    the gated output norm and the output projection. Under tensor parallelism split by heads: the input
    projections column-parallel, the output projection row-parallel, the conv's channels and the per-head
    parameters with their heads (`sharding.linear_heads` orders the conv channels by shard)."""
    e = config.hidden_size
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    key, value = hk * config.linear_key_head_dim, hv * config.linear_value_head_dim
    channels = 2 * key + value

    def proj(name: str, fan_in: int, fan_out: int, axes: tuple[str, str] = (EMBED, LINEAR_HEADS)) -> dict[str, Weight]:
        return blocks.linear(config, fan_in, fan_out, axes, f"linear_attn.{name}", f"ssm_{name}")

    return {
        "in_proj_qkv": proj("in_proj_qkv", e, channels),
        "in_proj_z": proj("in_proj_z", e, value),
        "in_proj_b": proj("in_proj_b", e, hv),
        "in_proj_a": proj("in_proj_a", e, hv),
        "out_proj": proj("out_proj", value, e, (LINEAR_HEADS, EMBED)),
        "gated_delta": {
            "conv1d": _per_head(config, (channels, config.linear_conv_kernel_dim), CONV, "conv1d.weight"),
            "A_log": _per_head(config, (hv,), BIAS, "A_log", float32=True),
            "dt_bias": _per_head(config, (hv,), BIAS, "dt_bias", float32=True),
        },
        "linear_norm": blocks.norm(config, "linear_attn.norm", "ssm_norm", config.linear_value_head_dim),
    }


def group_weights(config: ModelConfig, group: LayerGroup, mlp: Any, deltanet: Any) -> Declaration:
    """The stacked weights of one layer group, named by the model's layer numbers."""
    sub = group_config(config, group)
    block = deltanet(sub) if group.kind == LINEAR_ATTENTION else gated_attention(sub)
    declared = {**block, **blocks.llama_norms(sub), **mlp(sub)}
    return nest({path: dataclasses.replace(w, layer_ids=group.layers) for path, w in flat(declared).items()})


def mtp_weights(config: ModelConfig, mlp: Any) -> Declaration:
    """The MTP module (the module docstring): its norms and projection, unstacked, and its layers, stacked
    gated full-attention layers with `mlp(layer config)` named `mtp.layers.{i}.*`."""
    n, e = config.num_nextn_predict_layers, config.hidden_size
    sub = dataclasses.replace(config, num_layers=n, layer_types=(FULL_ATTENTION,) * n, num_nextn_predict_layers=0)
    layer = {**gated_attention(sub), **blocks.llama_norms(sub), **mlp(sub)}
    renamed = {
        path: dataclasses.replace(w, hf=w.hf.replace(blocks.HF_LAYER, "mtp.layers.{layer}.", 1), gguf=None)
        for path, w in flat(layer).items()
    }

    def norm(hf: str) -> dict[str, Weight]:
        return {"scale": Weight((e,), (EMBED,), SCALE, float32=True, hf=f"mtp.{hf}.weight")}

    return {
        "enorm": norm("pre_fc_norm_embedding"),
        "hnorm": norm("pre_fc_norm_hidden"),
        "eh_proj": {"kernel": Weight((2 * e, e), (None, EMBED), KERNEL, hf="mtp.fc.weight")},
        "head_norm": norm("norm"),
        "layer": nest(renamed),
    }


def hybrid_weights(config: ModelConfig, mlp: Any = blocks.dense_mlp, deltanet: Any = gated_deltanet) -> Declaration:
    """Embedding, head and each layer group's stacks (`mlp(group config)`: the MLP's weights;
    `deltanet(group config)`: the Gated DeltaNet block's), and the MTP module's when the config has one."""
    out = {
        **blocks.embedding_and_head(config),
        **{group.name: group_weights(config, group, mlp, deltanet) for group in layer_groups(config)},
    }
    if config.num_nextn_predict_layers:
        out["mtp"] = mtp_weights(config, mlp)
    return out


def hybrid_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ModelConfig fields of a Gated DeltaNet hybrid's `config.json` (Qwen3.5's, Qwen3-Next's)."""
    params = hf.get("rope_parameters") or {}
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    kinds = hf.get("layer_types") or [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    return {
        **common_fields(hf, architecture),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "qk_norm": True,
        "attn_output_gate": True,
        "layer_types": tuple(kinds),
        "partial_rotary_factor": float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        "linear_conv_kernel_dim": hf.get("linear_conv_kernel_dim", 4),
        "linear_key_head_dim": hf["linear_key_head_dim"],
        "linear_value_head_dim": hf["linear_value_head_dim"],
        "linear_num_key_heads": hf["linear_num_key_heads"],
        "linear_num_value_heads": hf["linear_num_value_heads"],
        "num_nextn_predict_layers": hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0,
    }


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Qwen3.5 with hidden_act {hf['hidden_act']!r} is not supported")
    return hybrid_fields(hf, "qwen3_5")


def hybrid_hf(config: ModelConfig, hf_class: str, model_type: str, mtp_field: str) -> dict[str, Any]:
    """The `config.json` fields `hybrid_fields` reads back; the MTP's layer count under `mtp_field`
    (written only when the model has MTP layers)."""
    d = common_hf(config, hf_class)
    if config.num_nextn_predict_layers:
        d[mtp_field] = config.num_nextn_predict_layers
    rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta"), **(d.pop("rope_scaling") or {})}
    return {
        **d,
        "model_type": model_type,
        "hidden_act": "silu",
        "rope_parameters": {**rope, "partial_rotary_factor": config.partial_rotary_factor},
        "layer_types": list(config.layer_types or ()),
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return hybrid_hf(config, "Qwen3_5ForCausalLM", "qwen3_5_text", "mtp_num_hidden_layers")


def _zero_centered(path: str) -> bool:
    return path.endswith("norm/scale") and not path.endswith("linear_norm/scale")


def from_hf_tensor(path: str, array: np.ndarray) -> np.ndarray:
    """Zero-centered norm weights as 1 + weight; the conv's taps [C, 1, K] as [C, K]."""
    if _zero_centered(path):
        return array + np.float32(1.0)
    return array.reshape(array.shape[0], -1) if path == CONV_PATH else array


def to_hf_tensor(path: str, array: np.ndarray) -> np.ndarray:
    if _zero_centered(path):
        return array - np.float32(1.0)
    return array[..., None, :] if path == CONV_PATH else array


ARCHITECTURE = Architecture(
    "qwen3_5",
    "Qwen3_5ForCausalLM",
    hybrid_weights,
    from_hf,
    to_hf,
    from_hf_tensor=from_hf_tensor,
    to_hf_tensor=to_hf_tensor,
    hf_model_type="qwen3_5_text",
)
