"""Read and write Hugging Face model directories of every family in `checkpoints/architectures/`.

Tensor names come from the family's declared weights (`Weight.hf`). A directory holds
`config.json`, the weights in one `*.safetensors` file or several with
`model.safetensors.index.json`, `tokenizer.json`, `tokenizer_config.json` (special tokens, chat
template) and optionally `generation_config.json` (extra eos ids). Hugging Face stores a linear
weight as `[out, in]`; our kernels are `[in, out]`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from checkpoints import hf_vision
from checkpoints.architectures import architecture, config_from_hf, config_to_hf, declare
from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError, UnsupportedCheckpointError
from checkpoints.loaded import LoadedModel, VisionTower
from checkpoints.params import ParamFiller, ParamTree, checkpoint_names, iter_leaves, resolve_dtype
from checkpoints.tokenizer_bundle import TokenizerBundle, load_tokenizer_files, merge_eos_ids, save_tokenizer_files
from checkpoints.weights import flat

INDEX_FILE = "model.safetensors.index.json"

# Buffers some older checkpoints saved alongside the weights; they are recomputed, never loaded.
_IGNORED_SUFFIX = "rotary_emb.inv_freq"
_MTP_PREFIX = "mtp."  # Qwen3-Next / Qwen3.5's multi-token prediction module (`qwen3_5.mtp_weights`)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e


def weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [directory / name for name in names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{file} (listed in {index}) not found")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights (PyTorch .bin files are not supported)")
    return files


def iter_tensors(file: Path) -> Iterator[tuple[str, np.ndarray]]:
    try:
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{file}: corrupted or truncated safetensors file: {e}") from e


def _load_config(directory: Path) -> tuple[ModelConfig, Any]:
    """The language model's config, and the vision tower's of a vision-language model."""
    hf_config = _read_json(directory / "config.json")
    try:
        if not hf_vision.is_multimodal(hf_config):
            return config_from_hf(hf_config), None
        config = config_from_hf(hf_vision.text_config(hf_config))
        return config, hf_vision.vision_config(hf_config, config.hidden_size, directory)
    except KeyError as e:
        raise CheckpointError(f"{directory}/config.json: missing field {e}") from e
    except ValueError as e:
        raise UnsupportedCheckpointError(f"{directory}/config.json: {e}") from e


def load_hf_dir(path: str | os.PathLike[str], dtype: Any = "float32") -> LoadedModel:
    """Load a Hugging Face model directory into config, parameters (as `dtype`) and tokenizer."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory not found: {directory}")
    config, vision = _load_config(directory)
    arch = architecture(config.architecture)
    family = None if vision is None else hf_vision.family(vision)
    names = (lambda w: w.hf) if family is None else (lambda w: family.text_name(w.hf))
    filler = ParamFiller(config, resolve_dtype(dtype), str(directory), names)
    tower = None if vision is None else hf_vision.VisionFiller(config, vision, resolve_dtype(dtype), str(directory))
    for file in weight_files(directory):
        for name, array in iter_tensors(file):
            if family is not None:
                name = family.canonical_name(name)
                if tower.put(name, array):
                    continue
            place = filler.place(name)
            if place is None:
                if name.endswith(_IGNORED_SUFFIX) or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if name.startswith(_MTP_PREFIX) and not config.num_nextn_predict_layers:
                    continue  # an MTP module the config does not count (as transformers drops it)
                raise UnsupportedCheckpointError(f"{file}: unexpected weight {name!r} {array.shape}")
            path = place[0]
            array = arch.from_hf_tensor(path, array)
            filler.put(name, array.swapaxes(-1, -2) if filler.weights[path].is_kernel else array)
    params = filler.finish()
    generation = directory / "generation_config.json"
    extra_eos = _read_json(generation).get("eos_token_id") if generation.is_file() else None
    tokenizer_bundle = load_tokenizer_files(directory, merge_eos_ids(config.eos_token_ids, extra_eos))
    vision_tower = None if tower is None else tower.finish()
    return LoadedModel(config=config, params=params, tokenizer_bundle=tokenizer_bundle, vision=vision_tower)


def _hf_tensors(params: ParamTree, config: ModelConfig, vision: Any = None) -> dict[str, np.ndarray]:
    """Parameters under Hugging Face names (inside a multimodal checkpoint's language model with
    a `vision` tower's config), `[out, in]`, contiguous."""
    arch = architecture(config.architecture)
    leaves = dict(iter_leaves(params))
    tensors: dict[str, np.ndarray] = {}
    for path, weight in flat(declare(config)).items():
        value = arch.to_hf_tensor(path, np.asarray(leaves[path]))
        for name, index in checkpoint_names(weight, weight.hf):
            name = name if vision is None else hf_vision.family(vision).text_name(name)
            part = value[index]
            tensors[name] = np.ascontiguousarray(part.swapaxes(-1, -2) if weight.is_kernel else part)
    return tensors


def _shards(tensors: dict[str, np.ndarray], max_shard_bytes: int | None) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    return shards


def save_hf_dir(
    params: ParamTree,
    config: ModelConfig,
    tokenizer: TokenizerBundle,
    path: str | os.PathLike[str],
    max_shard_bytes: int | None = None,
    vision: VisionTower | None = None,
) -> None:
    """Write a Hugging Face directory that `load_hf_dir` (and `transformers`) can read; with a
    `vision` tower, a vision-language model's (`Gemma3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`...).

    With `max_shard_bytes`, weights are split over several files with an index, as
    `transformers` does for large models.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(params, config, None if vision is None else vision.config)
    dtype = next(iter(tensors.values())).dtype
    hf_config = config_to_hf(config)
    if vision is not None:
        tensors.update(hf_vision.vision_tensors(vision))
        hf_config = hf_vision.multimodal_config(hf_config, vision.config)
        hf_vision.write_processor(vision.config, directory)
    hf_config["torch_dtype"] = str(dtype)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(tokenizer.eos_token_ids)}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_tokenizer_files(tokenizer, directory)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
