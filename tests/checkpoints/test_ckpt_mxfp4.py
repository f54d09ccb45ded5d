"""MXFP4 experts (gpt-oss): the unpacking against a hand-computed block, quantizing, loading a
checkpoint's blocks and scales as stored (uint8, no float kernel), and the experts' grouped matmuls
on them equal to the same matmuls on the dequantized kernels. (Greedy tokens of a tiny MXFP4
checkpoint against transformers: tests/test_model_families.py, family `gpt_oss_mxfp4`.)"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoints import mxfp4
from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.orbax_io import load_orbax, save_orbax
from checkpoints.params import iter_leaves
from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.model import experts
from jaxserve.model.expert_kernels import dequantize_mxfp4, expert_kernel
from jaxserve.runner.placement import plan_parallelism

# One output row of 32 inputs: byte 0 = 0x21 holds input 0 in its low nibble (code 1: 0.5) and
# input 1 in its high one (code 2: 1.0); 0x9F: input 2 = code 15 (-6), input 3 = code 9 (-0.5);
# 0x07 after that: even inputs code 7 (6), odd ones code 0 (0). Scale byte 128: times 2^1.
# A second row: 0x3B everywhere (-1.5, 1.5) at scale byte 125: times 2^-2.
BLOCKS = np.array([[[0x21, 0x9F] + [0x07] * 14], [[0x3B] * 16]], np.uint8)  # [2 rows, 1 block, 16]
SCALES = np.array([[128], [125]], np.uint8)
ROW_0 = [1.0, 2.0, -12.0, -1.0] + [12.0, 0.0] * 14
ROW_1 = [-0.375, 0.375] * 16


def test_unpacking_a_hand_computed_block():
    np.testing.assert_array_equal(mxfp4.dequantize(BLOCKS, SCALES), np.array([ROW_0, ROW_1], np.float32))
    kernel = dequantize_mxfp4(jnp.asarray(BLOCKS), jnp.asarray(SCALES), jnp.float32)  # [in, out]
    np.testing.assert_array_equal(np.asarray(kernel), np.array([ROW_0, ROW_1], np.float32).T)


def test_quantize_keeps_representable_values_and_bounds_the_rest():
    exact = np.array([ROW_0, ROW_1], np.float32).T[None]  # a kernel [1, 32 in, 2 out]
    stored = mxfp4.quantize(exact)
    assert stored["blocks"].shape == (1, 2, 1, 16) and stored["scales"].shape == (1, 2, 1)
    np.testing.assert_array_equal(mxfp4.dequantize(stored["blocks"], stored["scales"]).swapaxes(-1, -2), exact)
    w = np.random.default_rng(0).normal(size=(3, 64, 8)).astype(np.float32)
    stored = mxfp4.quantize(w)
    back = mxfp4.dequantize(stored["blocks"], stored["scales"]).swapaxes(-1, -2)
    # At most half the widest gap between codes (2, between 4 and 6) times the block's scale,
    # the least power of two over its max / 6, so under max / 3.
    block_max = np.abs(w.swapaxes(-1, -2).reshape(3, 8, 2, 32)).max(-1, keepdims=True)
    bound = np.broadcast_to(block_max / 3.0, (3, 8, 2, 32)).reshape(3, 8, 64).swapaxes(-1, -2)
    assert np.all(np.abs(back - w) <= bound)
    assert np.abs(back - w).max() > 0, "random values are not all representable"


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    model = build_tiny_random(family="gpt_oss_mxfp4")
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, directory)
    return model, directory


def test_blocks_and_scales_load_as_stored(mxfp4_dir):
    model, directory = mxfp4_dir
    stored = load_file(str(directory / "model.safetensors"))
    loaded = load_hf_dir(directory)
    assert loaded.config == model.config and loaded.config.experts_mxfp4
    for name, hf in (("expert_gate_up", "gate_up_proj"), ("expert_down", "down_proj")):
        leaves = loaded.params["layers"][name]
        assert "kernel" not in leaves, "the experts' kernels must not be dequantized at load"
        for leaf in ("blocks", "scales"):
            assert leaves[leaf].dtype == np.uint8
            for layer in range(model.config.num_layers):
                np.testing.assert_array_equal(
                    leaves[leaf][layer], stored[f"model.layers.{layer}.mlp.experts.{hf}_{leaf}"]
                )


@pytest.mark.parametrize("grouped", [experts.grouped_matmul_tiles, experts.grouped_matmul_ragged])
def test_experts_on_mxfp4_equal_experts_on_the_dequantized_kernels(mxfp4_dir, grouped):
    model, _ = mxfp4_dir
    cfg, layers = model.config, model.params["layers"]
    stacks = [
        {leaf: jnp.asarray(layers[name][leaf]) for leaf in ("blocks", "scales")}
        for name in ("expert_gate_up", "expert_down")
    ]
    floats = [dequantize_mxfp4(s["blocks"], s["scales"], jnp.float32) for s in stacks]
    rng = np.random.default_rng(1)
    t, k = 11, cfg.num_experts_per_tok
    x = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(cfg.num_experts)[:k] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    real = jnp.arange(t) < 9
    run = functools.partial(experts.clamped_expert_mlp, limit=1.0, alpha=1.702, grouped_matmul=grouped)
    bias = jnp.asarray(layers["expert_gate_up"]["bias"])
    for layer in range(cfg.num_layers):
        np.testing.assert_array_equal(
            np.asarray(expert_kernel(stacks[0], jnp.int32(layer), jnp.int32(1), jnp.float32)),
            np.asarray(floats[0][layer, 1]),
        )
        got = run(x, ids, weights, real, stacks[0], bias, stacks[1], jnp.int32(layer))
        want = run(x, ids, weights, real, floats[0], bias, floats[1], jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
        assert not np.asarray(got[9:]).any(), "padding rows are routed nowhere"


def test_tensor_parallelism_that_would_split_an_mxfp4_block_is_refused_at_start(mxfp4_dir):
    config = mxfp4_dir[0].config  # 32 hidden units per expert: one block
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* 32 hidden units \(MXFP4 blocks of 32\)"):
        plan_parallelism(config, EngineConfig(tensor_parallel_size=2))
    plan_parallelism(config, EngineConfig(expert_parallel_size=2))


def test_a_converted_checkpoint_keeps_the_blocks_and_scales(mxfp4_dir, tmp_path):
    """`jaxserve convert`'s Orbax checkpoint restores uint8 blocks and scales, not floats."""
    model, _ = mxfp4_dir
    save_orbax(model, tmp_path / "orbax")
    restored = dict(iter_leaves(load_orbax(tmp_path / "orbax").params))
    for path, leaf in iter_leaves(model.params):
        assert restored[path].dtype == leaf.dtype, path
        np.testing.assert_array_equal(restored[path], leaf)
