"""The fields of a Hugging Face `config.json` that every family shares, both ways.

transformers 5 writes RoPE settings as `rope_parameters` (with `rope_theta` inside; Gemma 3: one
dict per layer type); older configs, and most on the Hub, have `rope_theta` and `rope_scaling`.
Both are read; `to_hf` writes the older form, which transformers 5 reads too.
"""

from __future__ import annotations

from typing import Any

from checkpoints.config import ModelConfig


def eos_ids(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else ((value,) if value is not None else ())


def rope(
    params: dict[str, Any] | None, hf: dict[str, Any], default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from one `rope_parameters` dict, else from `rope_theta` / `rope_scaling`."""
    if params is None:
        return float(hf.get("rope_theta", default_theta)), hf.get("rope_scaling")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(params.get("rope_theta", default_theta)), (None if kind == "default" else scaling)


def common_fields(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ModelConfig fields of a Llama-shaped `config.json`."""
    heads = hf["num_attention_heads"]
    rope_params = hf.get("rope_parameters")
    theta, scaling = rope(rope_params if rope_params and "rope_theta" in rope_params else None, hf)
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size") or 0,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        architecture=architecture,
    )


def sliding_window(hf: dict[str, Any], default_on: bool) -> int | None:
    """The window of a family whose configs switch it with `use_sliding_window`."""
    return hf.get("sliding_window") if hf.get("use_sliding_window", default_on) else None


def common_hf(config: ModelConfig, hf_class: str) -> dict[str, Any]:
    """The `config.json` fields `common_fields` reads back."""
    d: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "max_position_embeddings": config.max_position_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
    }
    if config.sliding_window is not None:
        d["sliding_window"] = config.sliding_window
        d["use_sliding_window"] = True
    return d
