"""DeepSeek-V3: multi-head latent attention (MLA) and a mixture of experts with shared experts,
group-limited sigmoid routing, and dense MLPs in its first `first_k_dense_replace` layers.

MLA (per layer): queries through a low-rank pair `q_a_proj` -> RMS norm -> `q_b_proj` (or one
`q_proj` when `q_lora_rank` is None), each head's query being `qk_nope_head_dim` values without
position and `qk_rope_head_dim` rotated ones; `kv_a_proj_with_mqa` gives the latent (RMS normed,
`kv_lora_rank` values) and one rotated key shared by all heads; `kv_b_proj` decompresses the latent
into each head's key (no position) and value. Its kernel is read whole by the attention (to absorb
it into the queries and the output), so it is stored under `kv_b_proj/weight`, beside the kernels
that `Linear` reads.

Layer weights: attention and norms stacked over all layers; the dense MLP (`gate_proj`, ...)
stacked over the first `first_k_dense_replace` layers; the router, its score correction bias,
the routed experts and the shared experts (`shared_{gate,up,down}_proj`) stacked over the rest
(their Hugging Face names numbered from `first_k_dense_replace`, `Weight.layer_ids`).

The multi-token prediction layers (`num_nextn_predict_layers`, stored as `model.layers.{L}`,
... after the last layer) are declared under `mtp/` and loaded; the forward pass ignores them, MTP speculative
decoding runs the first (`jaxserve/speculative/mtp_model.py`).
"""

from __future__ import annotations

from typing import Any

from checkpoints.architectures.base import Architecture
from checkpoints.architectures.blocks import HF_LAYER, embedding_and_head
from checkpoints.architectures.hf_config import common_fields, common_hf
from checkpoints.config import ModelConfig
from checkpoints.weights import (
    BIAS,
    EMBED,
    EMBEDDING,
    EXPERT_FFW,
    EXPERTS,
    FFW,
    KERNEL,
    LAYERS,
    Q_HEADS,
    ROUTER,
    ROUTER_KERNEL,
    SCALE,
    VOCAB,
    Declaration,
    Weight,
)


class _Stack:
    """Weights stacked over `count` layers whose Hugging Face names start at layer `first`."""

    def __init__(self, config: ModelConfig, count: int, first: int) -> None:
        self.config, self.count, self.first = config, count, first

    def weight(self, shape: tuple[int, ...], axes: tuple, init: str, hf: str, quantizable: bool = False) -> Weight:
        return Weight(
            (self.count, *shape),
            (LAYERS, *axes),
            init,
            float32=init == SCALE,
            hf=HF_LAYER + hf,
            quantizable=quantizable,
            layer_ids=tuple(range(self.first, self.first + self.count)),
        )

    def linear(self, fan_in: int, fan_out: int, axes: tuple, hf: str, bias: bool = False) -> dict[str, Weight]:
        out = {"kernel": self.weight((fan_in, fan_out), axes, KERNEL, f"{hf}.weight", quantizable=True)}
        if bias:
            out["bias"] = self.weight((fan_out,), axes[1:], BIAS, f"{hf}.bias")
        return out

    def norm(self, size: int, hf: str) -> dict[str, Weight]:
        return {"scale": self.weight((size,), (EMBED if size == self.config.hidden_size else None,), SCALE, hf)}


def _attention(s: _Stack) -> Declaration:
    cfg = s.config
    e, h, bias = cfg.hidden_size, cfg.num_heads, cfg.attention_bias
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    r = cfg.kv_lora_rank
    out: Declaration = {
        "attn_norm": s.norm(e, "input_layernorm.weight"),
        "mlp_norm": s.norm(e, "post_attention_layernorm.weight"),
        "kv_a_proj": s.linear(e, r + cfg.qk_rope_head_dim, (EMBED, None), "self_attn.kv_a_proj_with_mqa", bias),
        "kv_a_norm": s.norm(r, "self_attn.kv_a_layernorm.weight"),
        "kv_b_proj": {
            "weight": s.weight(
                (r, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)), (None, Q_HEADS), KERNEL, "self_attn.kv_b_proj.weight"
            )
        },
        "o_proj": s.linear(h * cfg.v_head_dim, e, (Q_HEADS, EMBED), "self_attn.o_proj", bias),
    }
    if cfg.q_lora_rank is None:
        out["q_proj"] = s.linear(e, h * qk, (EMBED, Q_HEADS), "self_attn.q_proj")
    else:
        out["q_a_proj"] = s.linear(e, cfg.q_lora_rank, (EMBED, None), "self_attn.q_a_proj", bias)
        out["q_a_norm"] = s.norm(cfg.q_lora_rank, "self_attn.q_a_layernorm.weight")
        out["q_b_proj"] = s.linear(cfg.q_lora_rank, h * qk, (None, Q_HEADS), "self_attn.q_b_proj")
    return out


def _dense_mlp(s: _Stack, prefix: str, names: tuple[str, str, str], width: int) -> Declaration:
    e = s.config.hidden_size
    gate, up, down = names
    return {
        gate: s.linear(e, width, (EMBED, FFW), f"{prefix}.gate_proj"),
        up: s.linear(e, width, (EMBED, FFW), f"{prefix}.up_proj"),
        down: s.linear(width, e, (FFW, EMBED), f"{prefix}.down_proj"),
    }


def _experts(s: _Stack) -> Declaration:
    cfg = s.config
    e, f, x = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts

    def expert(fan_in: int, fan_out: int, axes: tuple, hf: str) -> dict[str, Weight]:
        name = f"mlp.experts.{{expert}}.{hf}.weight"
        return {"kernel": s.weight((x, fan_in, fan_out), (EXPERTS, *axes), KERNEL, name)}

    shared = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
    return {
        "router": {"kernel": s.weight((e, x), (EMBED, ROUTER), ROUTER_KERNEL, "mlp.gate.weight")},
        "expert_bias": {"bias": s.weight((x,), (ROUTER,), BIAS, "mlp.gate.e_score_correction_bias")},
        "expert_gate": expert(e, f, (EMBED, EXPERT_FFW), "gate_proj"),
        "expert_up": expert(e, f, (EMBED, EXPERT_FFW), "up_proj"),
        "expert_down": expert(f, e, (EXPERT_FFW, EMBED), "down_proj"),
        **_dense_mlp(s, "mlp.shared_experts", shared, f * cfg.n_shared_experts),
    }


def _mtp(config: ModelConfig) -> Declaration:
    """The multi-token prediction layers: a decoder layer (attention and experts) each, with the
    norms of the embedding and of the hidden state it takes, their projection, its head's norm, and
    the copies of the embedding and head its checkpoints store."""
    s = _Stack(config, config.num_nextn_predict_layers, config.num_layers)
    e, v = config.hidden_size, config.vocab_size
    return {
        "enorm": s.norm(e, "enorm.weight"),
        "hnorm": s.norm(e, "hnorm.weight"),
        "eh_proj": s.linear(2 * e, e, (None, EMBED), "eh_proj"),
        "head_norm": s.norm(e, "shared_head.norm.weight"),
        "embedding": {"table": s.weight((v, e), (VOCAB, EMBED), EMBEDDING, "embed_tokens.weight")},
        "head": {"kernel": s.weight((e, v), (EMBED, VOCAB), KERNEL, "shared_head.head.weight")},
        "layer": {**_attention(s), **_experts(s)},
    }


def weights(config: ModelConfig) -> Declaration:
    dense = config.first_k_dense_replace if config.num_experts else config.num_layers
    layers = _attention(_Stack(config, config.num_layers, 0))
    if dense:
        names = ("gate_proj", "up_proj", "down_proj")
        layers.update(_dense_mlp(_Stack(config, dense, 0), "mlp", names, config.intermediate_size))
    if config.num_layers > dense:
        layers.update(_experts(_Stack(config, config.num_layers - dense, dense)))
    out = {**embedding_and_head(config), "layers": layers}
    if config.num_nextn_predict_layers:
        out["mtp"] = _mtp(config)
    return out


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("quantization_config"):  # the published checkpoint: fp8 blocks with `weight_scale_inv`
        method = hf["quantization_config"].get("quant_method", "?")
        raise ValueError(f"DeepSeek-V3 quantized as {method!r} is not supported: dequantize it to bf16 first")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DeepSeek-V3 with hidden_act {hf['hidden_act']!r} is not supported")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("DeepSeek-V3 routing other than sigmoid scores with noaux_tc top-k is not supported")
    heads = hf["num_attention_heads"]
    return {
        **common_fields(hf, "deepseek_v3"),
        "head_dim": hf["qk_rope_head_dim"],
        "num_kv_heads": heads,
        "kv_lora_rank": hf["kv_lora_rank"],
        "q_lora_rank": hf.get("q_lora_rank"),
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "rope_interleave": bool(hf.get("rope_interleave", True)),
        "scoring_func": "sigmoid",
        "num_experts": hf["n_routed_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "n_group": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "n_shared_experts": hf.get("n_shared_experts") or 0,
        "first_k_dense_replace": hf.get("first_k_dense_replace") or 0,
        "num_nextn_predict_layers": hf.get("num_nextn_predict_layers") or 0,
    }


def to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        **common_hf(config, "DeepseekV3ForCausalLM"),
        "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": config.q_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "n_shared_experts": config.n_shared_experts,
        "first_k_dense_replace": config.first_k_dense_replace,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
    }


ARCHITECTURE = Architecture("deepseek_v3", "DeepseekV3ForCausalLM", weights, from_hf, to_hf)
