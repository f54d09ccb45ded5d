"""Weight declarations of the blocks families share: embedding and head, attention, norms, the
gated MLP and the mixture-of-experts MLP.

Parameter paths (the tree every loader fills; `[L, ...]` = stacked over layers):

    embed/embedding [V, E]
    layers/attn_norm/scale [L, E]
    layers/{q,k,v}_proj/kernel [L, E, heads*D]   (+ /bias [L, heads*D])
    layers/{q,k}_norm/scale [L, D]               (q/k norms)
    layers/o_proj/kernel [L, H*D, E]             (+ /bias [L, E])
    layers/post_attn_norm/scale [L, E]           (post norms)
    layers/mlp_norm/scale [L, E]
    layers/{gate,up}_proj/kernel [L, E, F], layers/down_proj/kernel [L, F, E]          (dense MLP)
    layers/router/kernel [L, E, X]; layers/expert_{gate,up}/kernel [L, X, E, F],
    layers/expert_down/kernel [L, X, F, E]      (X experts of F hidden units each)
    layers/post_mlp_norm/scale [L, E]            (post norms)
    final_norm/scale [E]
    lm_head/kernel [E, V]                        (absent when the embeddings are tied)

Hugging Face names are Llama's (`model.layers.{layer}.self_attn.q_proj.weight`, ...); GGUF
names are llama.cpp's (`blk.{layer}.attn_q.weight`, ...). Families whose checkpoints name a
tensor differently pass their own names.
"""

from __future__ import annotations

from checkpoints.config import ModelConfig
from checkpoints.weights import (
    BIAS,
    EMBED,
    EMBEDDING,
    EXPERT_FFW,
    EXPERTS,
    FFW,
    HEAD_DIM,
    KERNEL,
    KV_HEADS,
    LAYERS,
    Q_HEADS,
    ROUTER,
    ROUTER_KERNEL,
    SCALE,
    VOCAB,
    Declaration,
    Weight,
)

HF_LAYER = "model.layers.{layer}."
GGUF_LAYER = "blk.{layer}."


def _layer(
    config: ModelConfig,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    init: str,
    hf: str | None,
    gguf: str | None,
    quantizable: bool = False,
) -> Weight:
    """A per-layer weight, stacked over the layers; names relative to a layer's prefix."""
    return Weight(
        (config.num_layers, *shape),
        (LAYERS, *axes),
        init,
        float32=init == SCALE,
        hf=None if hf is None else HF_LAYER + hf,
        gguf=None if gguf is None else GGUF_LAYER + gguf,
        quantizable=quantizable,
    )


def norm(config: ModelConfig, hf: str, gguf: str, size: int | None = None) -> dict[str, Weight]:
    """A per-layer RMS norm over `size` features (default: the hidden size)."""
    return {
        "scale": _layer(
            config,
            (size or config.hidden_size,),
            (EMBED if size is None else HEAD_DIM,),
            SCALE,
            f"{hf}.weight",
            f"{gguf}.weight",
        )
    }


def linear(
    config: ModelConfig,
    fan_in: int,
    fan_out: int,
    axes: tuple[str | None, str | None],
    hf: str,
    gguf: str,
    bias: bool = False,
) -> dict[str, Weight]:
    """A per-layer projection [in, out], with its bias when `bias`; its kernel is quantizable."""
    out = {"kernel": _layer(config, (fan_in, fan_out), axes, KERNEL, f"{hf}.weight", f"{gguf}.weight", True)}
    if bias:
        out["bias"] = _layer(config, (fan_out,), axes[1:], BIAS, f"{hf}.bias", f"{gguf}.bias")
    return out


def embedding_and_head(config: ModelConfig) -> Declaration:
    v, e = config.vocab_size, config.hidden_size
    out: Declaration = {
        # tied: the table is the output head too, and quantizable as its kernel [E, V]
        "embed": {
            "embedding": Weight(
                (v, e),
                (VOCAB, EMBED),
                EMBEDDING,
                hf="model.embed_tokens.weight",
                gguf="token_embd.weight",
                quantizable=config.tie_word_embeddings,
            )
        },
        "final_norm": {
            "scale": Weight((e,), (EMBED,), SCALE, float32=True, hf="model.norm.weight", gguf="output_norm.weight")
        },
    }
    if not config.tie_word_embeddings:
        out["lm_head"] = {
            "kernel": Weight(
                (e, v), (EMBED, VOCAB), KERNEL, hf="lm_head.weight", gguf="output.weight", quantizable=True
            )
        }
    return out


def attention(config: ModelConfig) -> Declaration:
    """q/k/v/o projections (with q/k/v biases when `attention_bias`, an o bias when
    `attention_out_bias`), and the q/k norms when `qk_norm`."""
    e, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    bias = config.attention_bias
    out: Declaration = {
        "q_proj": linear(config, e, q, (EMBED, Q_HEADS), "self_attn.q_proj", "attn_q", bias),
        "k_proj": linear(config, e, kv, (EMBED, KV_HEADS), "self_attn.k_proj", "attn_k", bias),
        "v_proj": linear(config, e, kv, (EMBED, KV_HEADS), "self_attn.v_proj", "attn_v", bias),
        "o_proj": linear(config, q, e, (Q_HEADS, EMBED), "self_attn.o_proj", "attn_output", config.attention_out_bias),
    }
    if config.qk_norm:
        out["q_norm"] = norm(config, "self_attn.q_norm", "attn_q_norm", d)
        out["k_norm"] = norm(config, "self_attn.k_norm", "attn_k_norm", d)
    return out


def dense_mlp(config: ModelConfig) -> Declaration:
    e, f = config.hidden_size, config.intermediate_size
    return {
        "gate_proj": linear(config, e, f, (EMBED, FFW), "mlp.gate_proj", "ffn_gate"),
        "up_proj": linear(config, e, f, (EMBED, FFW), "mlp.up_proj", "ffn_up"),
        "down_proj": linear(config, f, e, (FFW, EMBED), "mlp.down_proj", "ffn_down"),
    }


def experts(config: ModelConfig, router_hf: str, expert_hf: str, gate: str, up: str, down: str) -> Declaration:
    """The router and the experts of a mixture-of-experts MLP. Hugging Face checkpoints hold one
    tensor per expert (`{expert_hf}.{expert}.{gate|up|down}.weight` under the layer), GGUF files one
    per layer for all experts (`ffn_{gate,up,down}_exps`)."""
    e, f, x = config.hidden_size, config.moe_intermediate_size, config.num_experts

    def expert(name: str, fan_in: int, fan_out: int, axes: tuple[str, str], hf: str, gguf: str) -> dict[str, Weight]:
        return {
            name: {
                "kernel": _layer(
                    config,
                    (x, fan_in, fan_out),
                    (EXPERTS, *axes),
                    KERNEL,
                    f"{expert_hf}.{{expert}}.{hf}.weight",
                    f"{gguf}.weight",
                )
            }
        }

    return {
        "router": {
            "kernel": _layer(
                config, (e, x), (EMBED, ROUTER), ROUTER_KERNEL, f"{router_hf}.weight", "ffn_gate_inp.weight"
            )
        },
        **expert("expert_gate", e, f, (EMBED, EXPERT_FFW), gate, "ffn_gate_exps"),
        **expert("expert_up", e, f, (EMBED, EXPERT_FFW), up, "ffn_up_exps"),
        **expert("expert_down", f, e, (EXPERT_FFW, EMBED), down, "ffn_down_exps"),
    }


def llama_norms(config: ModelConfig) -> Declaration:
    """The two norms of a Llama layer: before attention and before the MLP."""
    return {
        "attn_norm": norm(config, "input_layernorm", "attn_norm"),
        "mlp_norm": norm(config, "post_attention_layernorm", "ffn_norm"),
    }


def decoder(config: ModelConfig, norms: Declaration, mlp: Declaration) -> Declaration:
    """A whole decoder: embedding, head, and layers of attention, `norms` and `mlp`."""
    return {**embedding_and_head(config), "layers": {**attention(config), **norms, **mlp}}
