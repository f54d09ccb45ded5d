"""Load a GGUF file (llama.cpp's format) into the parameter tree, config and tokenizer.

Tensors are dequantized to float with `gguf.quants.dequantize` (every type it implements: the
K-quants, Q4/Q5/Q8, the IQ types, ...), or, with `quantized=True` (`--quantization gguf`), a
quantizable kernel whose layers are all Q8_0, or all 4-bit (Q4_0 / Q4_1 / Q4_K), is kept as its
blocks' codes and scales (`checkpoints.gguf_blocks`), never dequantized. GGUF stores a weight with
the Hugging Face `[out, in]` shape, so kernels are transposed to `[in, out]`. Tensor names and the file's
`general.architecture` come from the families' declarations (`checkpoints/architectures/`), and
each family undoes what llama.cpp's converter changed (`llama`: the Q/K row permutation of its
interleaved-pair RoPE).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from checkpoints.architectures import architecture, declare, from_gguf_name, gguf_names
from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError, UnsupportedCheckpointError
from checkpoints.gguf_blocks import FORMATS, block_arrays, stored_arrays
from checkpoints.gguf_tokenizer import build_gguf_tokenizer
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamFiller, ParamTree, checkpoint_names, iter_leaves, resolve_dtype
from checkpoints.quant_format import HEADS, QuantFormat
from checkpoints.tokenizer_bundle import TokenizerBundle, merge_eos_ids
from checkpoints.weights import flat, nest, quantizable

Q = gguf.GGMLQuantizationType
ROPE_FACTORS = "rope_freqs.weight"  # per-frequency RoPE divisors (Llama 3.1-style scaling)


@functools.cache
def supported_tensor_types() -> frozenset[gguf.GGMLQuantizationType]:
    """The tensor types `gguf.quants.dequantize` implements (probed with one zero block each)."""
    supported = set()
    for qtype in Q:
        if qtype not in gguf.GGML_QUANT_SIZES:
            continue
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros(block_bytes, np.uint8), qtype)
        except NotImplementedError:
            continue
        supported.add(qtype)
    return frozenset(supported)


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


def _rope_scaling(
    meta: dict[str, Any], arch: str, rope_factors: np.ndarray | None, source: str
) -> dict[str, Any] | None:
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
        return {
            "rope_type": "yarn",
            "factor": float(meta[f"{arch}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
        }
    raise UnsupportedCheckpointError(f"{source}: RoPE scaling {kind!r} in GGUF is not supported")


def config_from_metadata(
    meta: dict[str, Any], tensor_names: set[str], vocab_size: int, source: str, rope_factors: np.ndarray | None = None
) -> ModelConfig:
    """A ModelConfig from GGUF metadata (llama.cpp key names), the tensors present and the
    `rope_freqs` tensor's values, if the file has one: the fields every family shares, then the
    family's own (`Architecture.from_gguf`)."""
    arch = meta.get("general.architecture")
    family = from_gguf_name(arch)
    if family is None or family.from_gguf is None:
        raise UnsupportedCheckpointError(f"{source}: architecture {arch!r} is not supported; supported: {gguf_names()}")
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise UnsupportedCheckpointError(f"{source}: partial rotary embeddings ({rope_dim} of {head_dim})")
        if rope_factors is not None and rope_factors.shape != (head_dim // 2,):
            raise CheckpointError(f"{source}: rope_freqs has shape {rope_factors.shape}, expected ({head_dim // 2},)")
        fields = dict(
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
            architecture=family.name,
        )
        return ModelConfig(**{**fields, **family.from_gguf(meta, arch, tensor_names)})
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{source}: GGUF metadata is missing or malformed: {e}") from e


def _eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    return merge_eos_ids(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")))


def _tensor_array(tensor: Any, source: str) -> np.ndarray:
    if tensor.tensor_type not in supported_tensor_types():
        raise UnsupportedCheckpointError(
            f"{source}: tensor {tensor.name} has type {tensor.tensor_type.name}; supported types: "
            f"{sorted(t.name for t in supported_tensor_types())}"
        )
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


def _stored_formats(tensors: dict[str, Any], config: ModelConfig) -> dict[str, QuantFormat]:
    """{codes path: storage} of each quantizable kernel whose tensors share one stored format
    (the output head's too: a tied `token_embd` [V, E] in blocks along E is the head's kernel
    [E, V] in groups of its input features)."""
    out = {}
    for path, (_, w) in quantizable(declare(config)).items():
        names = [name for name, _ in checkpoint_names(w, w.gguf)]
        found = {FORMATS.get(tensors[name].tensor_type) if name in tensors else None for name in names}
        if len(found) == 1 and None not in found:
            out[path] = found.pop()
    return out


def _load_params(
    reader: gguf.GGUFReader, config: ModelConfig, dtype: np.dtype, source: str, quantized: bool = False
) -> ParamTree:
    family = architecture(config.architecture)
    formats = _stored_formats({t.name: t for t in reader.tensors}, config) if quantized else {}
    kernels = quantizable(declare(config))
    kept = {kernels[path][0] for path in formats}  # declared paths of the kernels kept quantized
    filler = ParamFiller(
        config,
        dtype,
        source,
        lambda w: w.gguf,
        {path: w for path, w in flat(declare(config)).items() if path not in kept},
    )
    stored, kept_quantized = {}, {}
    for path, fmt in formats.items():
        parent = path.rsplit("/", 1)[0]
        weight = kernels[path][1]
        for name, (shape, array_dtype) in fmt.arrays(weight.kernel_shape).items():
            stored[f"{parent}/{name}"] = np.empty(shape, array_dtype)
        kept_quantized.update({name: (path, index) for name, index in checkpoint_names(weight, weight.gguf)})
    for tensor in reader.tensors:
        if tensor.name == ROPE_FACTORS:  # part of the config, not a parameter
            continue
        if (
            tensor.name in kept_quantized
        ):  # a kernel kept quantized: its blocks' arrays, rows un-permuted as the weights'
            path, index = kept_quantized.pop(tensor.name)
            arrays = {
                name: family.from_gguf_tensor(path, a, config)
                for name, a in block_arrays(tensor.data, tensor.tensor_type).items()
            }
            parent = path.rsplit("/", 1)[0]
            for name, a in stored_arrays(arrays, formats[path]).items():
                stored[f"{parent}/{name}"][index] = a
            continue
        place = filler.place(tensor.name)
        if place is None:
            raise UnsupportedCheckpointError(
                f"{source}: unexpected tensor {tensor.name!r} (or it does not fit the config)"
            )
        path = place[0]
        array = family.from_gguf_tensor(path, _tensor_array(tensor, source), config)
        filler.put(tensor.name, array.swapaxes(-1, -2) if filler.weights[path].is_kernel else array)
    if kept_quantized:
        raise CheckpointError(f"{source}: missing tensors: {', '.join(sorted(kept_quantized)[:10])}")
    return nest({**dict(iter_leaves(filler.finish())), **stored})


def _read(path: Path) -> tuple[gguf.GGUFReader, dict[str, Any], ModelConfig]:
    """The file's reader (memory-mapped), metadata and config."""
    source = str(path)
    reader = _open(path)
    meta = _metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{source}: no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    rope_factors = _tensor_array(tensors[ROPE_FACTORS], source).reshape(-1) if ROPE_FACTORS in tensors else None
    return reader, meta, config_from_metadata(meta, set(tensors), vocab_size, source, rope_factors)


def load_gguf(path: str | os.PathLike[str], dtype: Any = "float32", quantized: bool = False) -> LoadedModel:
    """Load config, parameters (dequantized to `dtype`; with `quantized`, the kernels stored in
    Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K kept as their blocks' codes and scales) and tokenizer from a GGUF file."""
    path = Path(path)
    reader, meta, config = _read(path)
    params = _load_params(reader, config, resolve_dtype(dtype), str(path), quantized)
    return LoadedModel(config=config, params=params, tokenizer_bundle=_tokenizer_bundle(meta, config, str(path)))


def kept_layer_share(path: str | os.PathLike[str]) -> float:
    """The share of the layers' quantizable kernels' weights (the output head aside) that
    `load_gguf(path, quantized=True)` keeps as their blocks; the rest it dequantizes (a kernel of a
    type the kernels do not read, e.g. Q5_0 or Q6_K, or whose layers mix types). Reads the header only."""
    reader, _, config = _read(Path(path))
    tensors = {t.name: t for t in reader.tensors}
    kept = _stored_formats(tensors, config)
    sizes = {}
    for codes, (_, w) in quantizable(declare(config)).items():
        if codes not in HEADS:
            sizes[codes] = sum(int(tensors[n].n_elements) for n, _ in checkpoint_names(w, w.gguf) if n in tensors)
    total = sum(sizes.values())
    return sum(n for codes, n in sizes.items() if codes in kept) / total if total else 0.0


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
    family = architecture(config.architecture)
    chat_template = meta.get("tokenizer.chat_template") or family.chat_template
    end_of_turn = tokens.index(family.end_of_turn) if family.end_of_turn in tokens else None
    return TokenizerBundle(
        tokenizer=build_gguf_tokenizer(meta, source),
        chat_template=chat_template,
        special_tokens=special_tokens,
        eos_token_ids=merge_eos_ids(config.eos_token_ids, end_of_turn),
    )
