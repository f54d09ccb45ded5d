"""Load a GGUF file (llama.cpp's format) into the parameter tree, config and tokenizer.

Tensors are dequantized to float with `gguf.quants.dequantize`. GGUF stores a weight with the
Hugging Face `[out, in]` shape, so kernels are transposed to `[in, out]`. For the `llama`
architecture, llama.cpp's converter permutes the rows of the Q and K projections (per head,
the two halves of the head dimension are interleaved) to suit its interleaved-pair RoPE; we undo
that so the parameters use Hugging Face's "rotate half" RoPE. `qwen2` files are not permuted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError, UnsupportedCheckpointError
from checkpoints.gguf_tokenizer import build_gguf_tokenizer
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamFiller, ParamTree, resolve_dtype
from checkpoints.tokenizer_bundle import TokenizerBundle, merge_eos_ids

Q = gguf.GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K})
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
ROPE_FACTORS = "rope_freqs.weight"  # per-frequency RoPE divisors (Llama 3.1-style scaling)

# GGUF per-layer tensor name -> (module, leaf) in params["layers"].
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", "scale"),
    "attn_q.weight": ("q_proj", "kernel"),
    "attn_q.bias": ("q_proj", "bias"),
    "attn_k.weight": ("k_proj", "kernel"),
    "attn_k.bias": ("k_proj", "bias"),
    "attn_v.weight": ("v_proj", "kernel"),
    "attn_v.bias": ("v_proj", "bias"),
    "attn_output.weight": ("o_proj", "kernel"),
    "ffn_norm.weight": ("mlp_norm", "scale"),
    "ffn_gate.weight": ("gate_proj", "kernel"),
    "ffn_up.weight": ("up_proj", "kernel"),
    "ffn_down.weight": ("down_proj", "kernel"),
}
# Top-level GGUF tensor name -> (module, leaf).
_GLOBAL_TENSORS = {
    "token_embd.weight": ("embed", "embedding"),
    "output_norm.weight": ("final_norm", "scale"),
    "output.weight": ("lm_head", "kernel"),
}


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (works on `[out, in]` weights and `[out]` biases).

    llama.cpp's converter reshapes the rows of each head as (2, D/2) and swaps the axes, so
    rows (i, D/2 + i) of a head end up next to each other; this restores the original order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file (corrupted or truncated?): {e}") from e
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise CheckpointError(
                f"{path}: truncated: tensor {tensor.name} needs bytes up to "
                f"{tensor.data_offset + tensor.n_bytes}, file has {size}"
            )
    return reader


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _rope_scaling(meta: dict[str, Any], arch: str, rope_factors: np.ndarray | None,
                  source: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_factors is not None:
        if kind != "none":
            raise UnsupportedCheckpointError(f"{source}: both rope_freqs and RoPE scaling {kind!r}")
        # How llama.cpp carries Llama 3.1-style scaling: one divisor per frequency.
        return {"rope_type": "frequency_factors", "factors": [float(f) for f in rope_factors]}
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":  # llama.cpp's defaults are Hugging Face's (beta_fast 32, beta_slow 1)
        return {"rope_type": "yarn", "factor": float(meta[f"{arch}.rope.scaling.factor"]),
                "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"])}
    raise UnsupportedCheckpointError(f"{source}: RoPE scaling {kind!r} in GGUF is not supported")


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], vocab_size: int, source: str,
                         rope_factors: np.ndarray | None = None) -> ModelConfig:
    """A ModelConfig from GGUF metadata (llama.cpp key names), the tensors present and the
    `rope_freqs` tensor's values, if the file has one."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedCheckpointError(
            f"{source}: architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedCheckpointError(f"{source}: partial rotary embeddings ({rope_dim} of {head_dim})")
        if rope_factors is not None and rope_factors.shape != (head_dim // 2,):
            raise CheckpointError(f"{source}: rope_freqs has shape {rope_factors.shape}, expected ({head_dim // 2},)")
        return ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]),
            num_heads=heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(meta, arch, rope_factors, source),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 8192)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_eos_ids(meta),
            architecture=arch,
        )
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{source}: GGUF metadata is missing or malformed: {e}") from e


def _eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    return merge_eos_ids(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")))


def _tensor_array(tensor: Any, source: str) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedCheckpointError(
            f"{source}: tensor {tensor.name} has type {tensor.tensor_type.name}; supported types: "
            f"{sorted(t.name for t in SUPPORTED_TENSOR_TYPES)}"
        )
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


def _place(name: str, source: str) -> tuple[str, str, int | None]:
    """(module, leaf, layer or None) for a GGUF tensor name, or raise for an unknown tensor."""
    if name in _GLOBAL_TENSORS:
        return (*_GLOBAL_TENSORS[name], None)
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return (*_LAYER_TENSORS[parts[2]], int(parts[1]))
    raise UnsupportedCheckpointError(f"{source}: unexpected tensor {name!r}")


def _load_params(reader: gguf.GGUFReader, config: ModelConfig, dtype: np.dtype, source: str) -> ParamTree:
    filler = ParamFiller(config, dtype, source)
    unpermute_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FACTORS:  # part of the config, not a parameter
            continue
        module, leaf, layer = _place(tensor.name, source)
        if not filler.accepts(module, leaf, layer):
            raise UnsupportedCheckpointError(f"{source}: tensor {tensor.name} does not fit the config")
        array = _tensor_array(tensor, source)
        if config.architecture == "llama" and module in unpermute_heads:
            array = unpermute_rope_rows(array, unpermute_heads[module])
        filler.put(module, leaf, layer, array.T if leaf == "kernel" else array, tensor.name)
    return filler.finish()


def load_gguf(path: str | os.PathLike[str], dtype: Any = "float32") -> LoadedModel:
    """Load config, parameters (dequantized to `dtype`) and tokenizer from a GGUF file."""
    path = Path(path)
    source = str(path)
    reader = _open(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{source}: no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    rope_factors = _tensor_array(tensors[ROPE_FACTORS], source).reshape(-1) if ROPE_FACTORS in tensors else None
    config = config_from_metadata(meta, set(tensors), vocab_size, source, rope_factors)
    params = _load_params(reader, config, resolve_dtype(dtype), source)
    return LoadedModel(config=config, params=params, tokenizer_bundle=_tokenizer_bundle(meta, config, source))


def _tokenizer_bundle(meta: dict[str, Any], config: ModelConfig, source: str) -> TokenizerBundle:
    try:
        tokens = meta["tokenizer.ggml.tokens"]
    except KeyError:
        raise CheckpointError(f"{source}: no tokenizer in the GGUF metadata") from None
    special_tokens = {
        name: tokens[meta[key]]
        for name, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        )
        if meta.get(key) is not None and meta[key] < len(tokens)
    }
    return TokenizerBundle(
        tokenizer=build_gguf_tokenizer(meta, source),
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=special_tokens,
        eos_token_ids=config.eos_token_ids,
    )
