"""Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5's hybrid of Gated DeltaNet and gated full-attention
layers (`qwen3_5.py`), with a mixture-of-experts MLP in every layer: softmax over the experts, top-k
(renormalised with `norm_topk_prob`), plus a shared expert whose output is scaled by a sigmoid gate
of its own. Its Gated DeltaNet projections are fused as checkpoints store them, grouped by key head:
`in_proj_qkvz` rows per key head [q (d_k), k (d_k), v, z (each H_v / H_k value heads)], `in_proj_ba`
[b, a (H_v / H_k each)] (the block splits them: `jaxserve.model.gated_deltanet`), so a tensor-parallel
split of whole key-head groups keeps each head's pieces on one device. Configs with dense
layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused. Its MTP
module (`mtp.*`, counted by `num_nextn_predict_layers`) is Qwen3.5's (`qwen3_5.mtp_weights`) with this MLP.
"""

from __future__ import annotations

from typing import Any

from checkpoints.architectures import blocks
from checkpoints.architectures.base import Architecture
from checkpoints.architectures.qwen3_5 import (
    from_hf_tensor,
    gated_deltanet,
    hybrid_fields,
    hybrid_hf,
    hybrid_weights,
    to_hf_tensor,
)
from checkpoints.config import ModelConfig
from checkpoints.weights import EMBED, FFW, LINEAR_HEADS, Declaration

HEADS = (EMBED, LINEAR_HEADS)  # the fused projections' outputs, grouped by key head: split like the heads


def fused_deltanet(config: ModelConfig) -> Declaration:
    """Qwen3.5's Gated DeltaNet block with the input projections fused by key head."""
    e, hk, hv = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads
    group = 2 * config.linear_key_head_dim + 2 * (hv // hk) * config.linear_value_head_dim
    separate = gated_deltanet(config)
    fused = {
        "in_proj_qkvz": blocks.linear(config, e, hk * group, HEADS, "linear_attn.in_proj_qkvz", "ssm_in"),
        "in_proj_ba": blocks.linear(config, e, 2 * hv, HEADS, "linear_attn.in_proj_ba", "ssm_ba"),
    }
    return {**{k: v for k, v in separate.items() if not k.startswith("in_proj_")}, **fused}


def moe_with_shared_expert(config: ModelConfig) -> Declaration:
    """The router and experts (`blocks.experts`), the shared expert and its gate [E, 1]."""
    e, f = config.hidden_size, config.shared_expert_intermediate_size
    return {
        **blocks.experts(config, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
        "shared_gate_proj": blocks.linear(config, e, f, (EMBED, FFW), "mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
        "shared_up_proj": blocks.linear(config, e, f, (EMBED, FFW), "mlp.shared_expert.up_proj", "ffn_up_shexp"),
        "shared_down_proj": blocks.linear(config, f, e, (FFW, EMBED), "mlp.shared_expert.down_proj", "ffn_down_shexp"),
        "shared_expert_gate": blocks.linear(config, e, 1, (None, None), "mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
    }


def weights(config: ModelConfig) -> Declaration:
    return hybrid_weights(config, moe_with_shared_expert, fused_deltanet)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError("Qwen3-Next with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Qwen3-Next with hidden_act {hf['hidden_act']!r} is not supported")
    return {
        **hybrid_fields(hf, "qwen3_next"),
        "num_experts": hf["num_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "shared_expert_intermediate_size": hf["shared_expert_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        **hybrid_hf(config, "Qwen3NextForCausalLM", "qwen3_next", "num_nextn_predict_layers"),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


ARCHITECTURE = Architecture(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    weights,
    from_hf,
    to_hf,
    from_hf_tensor=from_hf_tensor,
    to_hf_tensor=to_hf_tensor,
)
