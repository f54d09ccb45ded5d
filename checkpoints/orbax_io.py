"""Save and restore a converted model: parameters with orbax-checkpoint, config and tokenizer as files.

Layout of a converted directory:

    params/                  orbax PyTree checkpoint of the parameter tree (dtype as saved, uncompressed)
    tokenizer.json           Hugging Face tokenizer
    tokenizer_config.json    special tokens and chat template (Hugging Face format)
    jaxserve_model.json      format marker, ModelConfig, eos ids; written last, so its presence
                             means the directory is complete

Restoring reads the arrays straight from disk (no dequantization), and can place them directly
into shards: pass a pytree of `jax.sharding.Sharding` shaped like the parameter tree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.errors import CheckpointError
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamTree, param_shapes, resolve_dtype, validate_params
from checkpoints.tokenizer_bundle import load_tokenizer_files, save_tokenizer_files
from checkpoints.weights import flat, nest

MANIFEST = "jaxserve_model.json"
FORMAT = "jaxserve-orbax"
VERSION = 1


def is_orbax_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def save_orbax(model: LoadedModel, path: str | os.PathLike[str]) -> None:
    """Write `model` to a new directory `path` (which must not exist yet)."""
    directory = Path(path)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists")
    validate_params(model.params, model.config, "save_orbax")
    directory.mkdir(parents=True)
    params = jax.tree.map(np.asarray, model.params)
    # Uncompressed: restoring the default model is ~2x faster without zstd (and load time is
    # what this format is for); it costs ~1.5x the disk space.
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    checkpointer.save((directory / "params").absolute(), args=ocp.args.PyTreeSave(params))
    save_tokenizer_files(model.tokenizer_bundle, directory)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "config": model.config.to_dict(),
        "eos_token_ids": list(model.tokenizer_bundle.eos_token_ids),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _read_manifest(directory: Path) -> dict[str, Any]:
    manifest_file = directory / MANIFEST
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{directory}: not a converted jaxserve checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{manifest_file}: invalid JSON: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_file}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    return manifest


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model config of a converted checkpoint, without reading its parameters."""
    return ModelConfig.from_dict(_read_manifest(Path(path))["config"])


def _restore_args(config: ModelConfig, dtype: np.dtype, shardings: Any) -> ParamTree:
    """Each leaf restored as `dtype`, but arrays declared with a storage of their own (codes, such
    as gpt-oss's MXFP4 blocks and scales) as stored."""
    shapes = param_shapes(config)
    dtypes = nest({path: np.dtype(w.storage or dtype) for path, w in flat(declare(config)).items()})
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731 - shapes are the leaves here
    if shardings is None:
        return jax.tree.map(
            lambda _, leaf_dtype: ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf_dtype),
            shapes,
            dtypes,
            is_leaf=is_shape,
        )
    return jax.tree.map(
        lambda shape, leaf_dtype, sharding: ocp.ArrayRestoreArgs(
            sharding=sharding, global_shape=shape, dtype=leaf_dtype
        ),
        shapes,
        dtypes,
        shardings,
        is_leaf=is_shape,
    )


def load_orbax(path: str | os.PathLike[str], dtype: Any = "float32", shardings: Any = None) -> LoadedModel:
    """Restore a directory written by `save_orbax`.

    Without `shardings` the parameters come back as numpy arrays; with a pytree of
    `jax.sharding.Sharding` (same nesting as the parameter tree) as `jax.Array`s laid out by it.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"converted checkpoint not found: {directory}")
    manifest = _read_manifest(directory)
    config = ModelConfig.from_dict(manifest["config"])
    restore_args = _restore_args(config, resolve_dtype(dtype), shardings)
    try:
        params = ocp.PyTreeCheckpointer().restore(
            (directory / "params").absolute(), args=ocp.args.PyTreeRestore(restore_args=restore_args)
        )
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: cannot restore parameters: {e}") from e
    validate_params(params, config, str(directory))
    tokenizer_bundle = load_tokenizer_files(directory, manifest.get("eos_token_ids"))
    return LoadedModel(config=config, params=params, tokenizer_bundle=tokenizer_bundle)
