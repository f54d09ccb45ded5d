"""Draft models for speculative decoding tests: a target's noisy copy (same tokenizer and shapes), which
agrees with the target often but not always, so drafts are both accepted and rejected; and a random
model of one layer, whose drafts are almost never accepted."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from checkpoints.loaded import LoadedModel
from checkpoints.orbax_io import save_orbax
from checkpoints.tiny_random import build_tiny_random


def noisy_copy(model: LoadedModel, scale: float, seed: int) -> LoadedModel:
    """The model with Gaussian noise of `scale` times each weight's spread added."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: (x + rng.normal(0, scale * x.std(), x.shape)).astype(x.dtype), model.params)
    return LoadedModel(config=model.config, params=params, tokenizer_bundle=model.tokenizer_bundle)


def write_drafts(target: LoadedModel, root: Path) -> dict[str, str]:
    """Directories of two drafts of `target`: "noisy" (its noisy copy) and "small" (a random one-layer model)."""
    save_orbax(noisy_copy(target, 0.35, seed=1), root / "noisy")
    save_orbax(build_tiny_random(seed=7, num_layers=1), root / "small")
    return {"noisy": str(root / "noisy"), "small": str(root / "small")}
