"""A model of a given shape with random weights made on the device: nothing to download or carry.

The weights are drawn inside one jitted program whose outputs are already in the runner's
shardings, so an 8B-parameter model (16 GB in bf16) never exists on the host and is never
copied; with XLA's bit generator (`unsafe_rbg`), whose draws fuse into their consumers (threefry's
counters would take ~73 GB of scratch for the 8B model), as the architecture's declared weights
say (`checkpoints.weights.device_initializer`). Norm scales are f32 and everything else is in the
compute dtype, as `ModelRunner` would cast them, so the runner takes the arrays as they are.
The tokenizer maps id i to the
word `t<i>`: prompts are token ids, and detokenizing costs what a real vocabulary's would.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, models

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.loaded import LoadedModel
from checkpoints.params import ParamTree
from checkpoints.tokenizer_bundle import TokenizerBundle
from checkpoints.weights import device_initializer


def random_params_on_device(config: ModelConfig, dtype: Any, shardings: Any, seed: int = 0) -> ParamTree:
    """The parameter tree of `config`, random as its declaration says, placed as `shardings`."""
    init = device_initializer(declare(config), jnp.dtype(dtype), seed)
    return jax.block_until_ready(jax.jit(init, out_shardings=shardings)())


def ids_tokenizer_bundle(vocab_size: int) -> TokenizerBundle:
    """A word-level tokenizer over `vocab_size` words `t0 .. t<V-1>`, no special tokens, no EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return TokenizerBundle(tokenizer=tokenizer, chat_template=None, special_tokens={}, eos_token_ids=())


def random_model(config: ModelConfig, dtype: Any, shardings: Any, seed: int = 0) -> LoadedModel:
    return LoadedModel(
        config, random_params_on_device(config, dtype, shardings, seed), ids_tokenizer_bundle(config.vocab_size)
    )


def weight_bytes_per_decode_step(params: ParamTree, config: ModelConfig) -> int:
    """Bytes of weights one decode step reads: every leaf, except that an untied embedding table
    is only gathered (a few rows), not read whole."""
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    if not config.tie_word_embeddings:
        embedding = params["embed"]["embedding"]
        total -= int(np.prod(embedding.shape)) * embedding.dtype.itemsize
    return total
