"""The Gated DeltaNet's conv channels in shard order (`sharding.linear_heads`), in process: each
shard's contiguous slice holds exactly its key heads' queries and keys and their value heads'
values; one shard keeps the checkpoints' order; the model reads the order back (`_split`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.tiny_random import TINY_FAMILIES, random_params, tiny_random_config
from jaxserve.model.gated_deltanet import GatedDeltaNet
from sharding.linear_heads import channel_order, shard_linear_channels

CONFIG = tiny_random_config(**{**TINY_FAMILIES["qwen3_5"], "linear_num_key_heads": 4, "linear_num_value_heads": 8})


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_each_shard_holds_its_heads_channels(shards):
    hk, dk = CONFIG.linear_num_key_heads, CONFIG.linear_key_head_dim
    hv, dv = CONFIG.linear_num_value_heads, CONFIG.linear_value_head_dim
    order = channel_order(CONFIG, shards)
    assert sorted(order) == list(range(2 * hk * dk + hv * dv))
    for s, part in enumerate(np.split(order, shards)):
        keys = range(s * hk // shards * dk, (s + 1) * hk // shards * dk)
        values = range(s * hv // shards * dv, (s + 1) * hv // shards * dv)
        expected = [*keys, *(hk * dk + c for c in keys), *(2 * hk * dk + c for c in values)]
        assert list(part) == expected


def test_the_model_splits_reordered_channels_into_the_same_heads():
    """Conv outputs in shard order, split by a model built with `linear_shards`, give the q, k, v
    of the checkpoint's order split on one device."""
    channels = np.random.default_rng(0).standard_normal((3, 2 * 4 * 16 + 8 * 16)).astype(np.float32)
    one = GatedDeltaNet(CONFIG, None, jnp.float32)._split(jnp.asarray(channels))
    four = dataclasses.replace(CONFIG, linear_shards=4)
    split = GatedDeltaNet(four, None, jnp.float32)._split(jnp.asarray(channels[:, channel_order(CONFIG, 4)]))
    for a, b in zip(one, split):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_only_the_conv_channels_move():
    params = random_params(CONFIG)
    moved = shard_linear_channels(params, CONFIG, 2)
    order = channel_order(CONFIG, 2)
    kernel = params["linear_layers"]["in_proj_qkv"]["kernel"]
    np.testing.assert_array_equal(moved["linear_layers"]["in_proj_qkv"]["kernel"], kernel[..., order])
    conv = params["linear_layers"]["gated_delta"]["conv1d"]
    np.testing.assert_array_equal(moved["linear_layers"]["gated_delta"]["conv1d"], conv[:, order])
    assert moved["linear_layers"]["in_proj_z"]["kernel"] is params["linear_layers"]["in_proj_z"]["kernel"]
    assert shard_linear_channels(params, CONFIG, 1) is params
