"""Draft models for speculative decoding tests: a target's noisy copy (same tokenizer and shapes), which
agrees with the target often but not always, so drafts are both accepted and rejected."""

from __future__ import annotations

import jax
import numpy as np

from checkpoints.loaded import LoadedModel


def noisy_copy(model: LoadedModel, scale: float, seed: int) -> LoadedModel:
    """The model with Gaussian noise of `scale` times each weight's spread added."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: (x + rng.normal(0, scale * x.std(), x.shape)).astype(x.dtype), model.params)
    return LoadedModel(config=model.config, params=params, tokenizer_bundle=model.tokenizer_bundle)
