"""EAGLE-3 heads for the tests, written as vLLM's and SpecForge's layout (config.json + model.safetensors) into a
directory at test time: a random one for a target, and one built to predict a "successor" target exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from checkpoints.config import ModelConfig
from checkpoints.loaded import LoadedModel


def head_config(target: ModelConfig, draft_vocab: int, aux_layers: list[int] | None) -> dict:
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    if aux_layers is not None:
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    return hf


def random_head_weights(hf: dict, seed: int = 0, with_embedding: bool = False) -> dict[str, np.ndarray]:
    """Random weights in torch's layout ([out, in]), scaled to keep activations near unit variance, and a
    draft vocabulary of every other target id (d2t / t2d)."""
    rng = np.random.default_rng(seed)
    e, inter, vocab, draft = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["draft_vocab_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]

    def dense(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    targets = np.sort(rng.choice(vocab, draft, replace=False))
    t2d = np.zeros(vocab, np.bool_)
    t2d[targets] = True
    w = {
        "fc.weight": dense(e, 3 * e),
        "midlayer.self_attn.q_proj.weight": dense(q, 2 * e),
        "midlayer.self_attn.k_proj.weight": dense(kv, 2 * e),
        "midlayer.self_attn.v_proj.weight": dense(kv, 2 * e),
        "midlayer.self_attn.o_proj.weight": dense(e, q),
        "midlayer.mlp.gate_proj.weight": dense(inter, e),
        "midlayer.mlp.up_proj.weight": dense(inter, e),
        "midlayer.mlp.down_proj.weight": dense(e, inter),
        "lm_head.weight": 4 * dense(draft, e),
        "d2t": (targets - np.arange(draft)).astype(np.int64),
        "t2d": t2d,
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
    w["norm.weight"] = np.ones(e, np.float32)
    if with_embedding:
        w["embed_tokens.weight"] = rng.standard_normal((vocab, e)).astype(np.float32)
    return w


def write_head(directory: Path, hf: dict, weights: dict[str, np.ndarray]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(weights, str(directory / "model.safetensors"))
    return str(directory)


def random_head(directory: Path, target: ModelConfig, aux_layers: list[int] | None = (0, 1, 1), **kw) -> str:
    """A random head for `target` (draft vocabulary: half the target's) saved at `directory`."""
    hf = head_config(target, target.vocab_size // 2, None if aux_layers is None else list(aux_layers))
    return write_head(directory, hf, random_head_weights(hf, **kw))


def successor_head(directory: Path, successor: LoadedModel) -> str:
    """For `mtp_models.successor_model`'s kind of target (every layer adds nothing, the next token after t is
    t + 1): a head whose fc takes the embedding (aux layer 0: e(t_i)), whose attention and MLP add nothing, and
    whose draft ids are the target's rolled by 7 with lm_head row d = e(target(d) - 2): from position i it drafts
    t_i + 2 = t_{i+2}, always right; a chained draft reads its own output, e(t_i) again, so it repeats itself."""
    emb = np.asarray(successor.params["embed"]["embedding"], np.float32)
    vocab, e = emb.shape
    hf = head_config(successor.config, vocab, [0, 1, 1])
    w = random_head_weights(hf)
    fc = np.zeros((e, 3 * e), np.float32)
    fc[:, :e] = np.eye(e)
    targets = (np.arange(vocab) + 7) % vocab
    w.update(
        {
            "fc.weight": fc,
            "midlayer.self_attn.o_proj.weight": np.zeros_like(w["midlayer.self_attn.o_proj.weight"]),
            "midlayer.mlp.down_proj.weight": np.zeros_like(w["midlayer.mlp.down_proj.weight"]),
            "midlayer.hidden_norm.weight": np.ones(e, np.float32),
            "lm_head.weight": emb[(targets - 2) % vocab].copy(),
            "d2t": (targets - np.arange(vocab)).astype(np.int64),
            "t2d": np.ones(vocab, np.bool_),
        }
    )
    return write_head(directory, hf, w)
