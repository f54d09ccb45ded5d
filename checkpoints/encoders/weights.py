"""The declared weights of a BERT-family encoder (`checkpoints.weights`): shapes, logical axes,
initialisers and the tensor names of Hugging Face (BERT) and GGUF (llama.cpp's `bert` and
`nomic-bert`) checkpoints. Per-layer weights are stacked under `layers`."""

from __future__ import annotations

from checkpoints.encoders.config import EncoderConfig
from checkpoints.weights import (
    BIAS,
    EMBED,
    EMBEDDING,
    FFW,
    KERNEL,
    LAYERS,
    Q_HEADS,
    SCALE,
    VOCAB,
    Declaration,
    Weight,
)

_HF_LAYER = "encoder.layer.{layer}."
_GGUF = "blk.{layer}."


def _norm(hf: str | None, gguf: str, stacked: int | None, size: int) -> dict[str, Weight]:
    """A LayerNorm's scale and bias (f32)."""
    shape, axes = ((stacked, size), (LAYERS, EMBED)) if stacked else ((size,), (EMBED,))
    return {
        "scale": Weight(shape, axes, SCALE, float32=True, hf=hf and f"{hf}.weight", gguf=f"{gguf}.weight"),
        "bias": Weight(shape, axes, BIAS, float32=True, hf=hf and f"{hf}.bias", gguf=f"{gguf}.bias"),
    }


def _linear(config: EncoderConfig, n_in: int, n_out: int, axes: tuple, hf: str | None, gguf: str) -> dict:
    """A stacked projection `[layers, in, out]`, with a bias in BERT (nomic-bert has none)."""
    layers = config.num_layers
    out = {
        "kernel": Weight(
            (layers, n_in, n_out), (LAYERS, *axes), KERNEL, hf=hf and f"{hf}.weight", gguf=gguf + ".weight"
        )
    }
    if config.architecture == "bert":
        out["bias"] = Weight((layers, n_out), (LAYERS, axes[1]), BIAS, hf=f"{hf}.bias", gguf=gguf + ".bias")
    return out


def _attention(config: EncoderConfig) -> dict:
    e = config.hidden_size
    if config.rotary:  # nomic-bert: one fused projection [q | k | v]
        return {"qkv": _linear(config, e, 3 * e, (EMBED, Q_HEADS), None, "blk.{layer}.attn_qkv")}
    h = _HF_LAYER + "attention.self."
    return {
        "q": _linear(config, e, e, (EMBED, Q_HEADS), h + "query", "blk.{layer}.attn_q"),
        "k": _linear(config, e, e, (EMBED, Q_HEADS), h + "key", "blk.{layer}.attn_k"),
        "v": _linear(config, e, e, (EMBED, Q_HEADS), h + "value", "blk.{layer}.attn_v"),
    }


def _mlp(config: EncoderConfig) -> dict:
    e, f, h = config.hidden_size, config.intermediate_size, _HF_LAYER
    mlp = {
        "up": _linear(config, e, f, (EMBED, FFW), h + "intermediate.dense", "blk.{layer}.ffn_up"),
        "down": _linear(config, f, e, (FFW, EMBED), h + "output.dense", "blk.{layer}.ffn_down"),
    }
    if config.architecture == "nomic_bert":  # SwiGLU: up * silu(gate)
        mlp["gate"] = _linear(config, e, f, (EMBED, FFW), None, "blk.{layer}.ffn_gate")
    return mlp


def declare_encoder(config: EncoderConfig) -> Declaration:
    """Every weight of an encoder of `config`."""
    e, n = config.hidden_size, config.num_layers
    embed = {
        "tokens": Weight(
            (config.vocab_size, e),
            (VOCAB, EMBED),
            EMBEDDING,
            hf="embeddings.word_embeddings.weight",
            gguf="token_embd.weight",
        ),
        "token_types": Weight(
            (config.type_vocab_size, e),
            (None, EMBED),
            EMBEDDING,
            hf="embeddings.token_type_embeddings.weight",
            gguf="token_types.weight",
        ),
        "norm": _norm("embeddings.LayerNorm", "token_embd_norm", None, e),
    }
    if not config.rotary:
        embed["positions"] = Weight(
            (config.max_position_embeddings, e),
            (None, EMBED),
            EMBEDDING,
            hf="embeddings.position_embeddings.weight",
            gguf="position_embd.weight",
        )
    layers = {
        **_attention(config),
        "attn_out": _linear(
            config, e, e, (Q_HEADS, EMBED), _HF_LAYER + "attention.output.dense", "blk.{layer}.attn_output"
        ),
        "attn_norm": _norm(_HF_LAYER + "attention.output.LayerNorm", "blk.{layer}.attn_output_norm", n, e),
        **_mlp(config),
        "mlp_norm": _norm(_HF_LAYER + "output.LayerNorm", "blk.{layer}.layer_output_norm", n, e),
    }
    out = {"embed": embed, "layers": layers}
    if config.is_cross_encoder:  # BertForSequenceClassification's head (directories only)
        out["pooler"] = {
            "kernel": Weight((e, e), (EMBED, None), KERNEL, hf="pooler.dense.weight"),
            "bias": Weight((e,), (None,), BIAS, hf="pooler.dense.bias"),
        }
        out["classifier"] = {
            "kernel": Weight((e, config.num_labels), (EMBED, None), KERNEL, hf="classifier.weight"),
            "bias": Weight((config.num_labels,), (None,), BIAS, hf="classifier.bias"),
        }
    return out
