"""Mesh checks, the tensor-parallel plan, kv-head replication and the partition rules, in
process (specs only need the mesh's axis sizes: an AbstractMesh stands in for 4 devices)."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from checkpoints.architectures import declare
from checkpoints.params import param_shapes
from checkpoints.quantize import formats_of, quantize_params
from checkpoints.tiny_random import random_params, tiny_random_config
from checkpoints.weights import flat
from sharding.kv_heads import replicate_kv_heads
from sharding.mesh import make_mesh, plan_tensor_parallel, replica_meshes
from sharding.rules import param_shardings, spec_for

TP4 = AbstractMesh((1, 4), ("dp", "tp"))


def test_mesh_larger_than_the_devices_is_refused():
    with pytest.raises(ValueError, match=r"dp x tp = 2 x 4 = 8 devices requested, but only 1 are visible"):
        make_mesh(tensor_parallel_size=4, data_parallel_size=2)
    with pytest.raises(ValueError, match=">= 1"):
        make_mesh(tensor_parallel_size=0)


def test_replica_meshes_are_the_rows_of_the_mesh():
    devices = jax.devices()[:1]
    (only,) = replica_meshes(make_mesh(1, 1, devices))
    assert dict(only.shape) == {"dp": 1, "pp": 1, "ep": 1, "tp": 1} and list(only.devices.flat) == devices


@pytest.mark.parametrize(
    "heads, kv_heads", [(h, k) for h in (1, 2, 4, 6, 8, 9, 12, 16) for k in (1, 2, 3, 4, 6, 8) if h % k == 0]
)
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8])
def test_every_query_head_reads_its_own_kv_head_after_replication(heads, kv_heads, tp):
    if heads % tp:
        with pytest.raises(ValueError, match="does not divide"):
            plan_tensor_parallel(heads, kv_heads, tp)
        return
    plan = plan_tensor_parallel(heads, kv_heads, tp)
    served, r = plan.served_kv_heads, plan.kv_replicas
    assert served % tp == 0 and heads % served == 0 and served == kv_heads * r
    for shard in range(tp):  # the heads a shard owns, and the kv heads they read
        q = range(shard * heads // tp, (shard + 1) * heads // tp)
        local_kv = range(shard * served // tp, (shard + 1) * served // tp)
        for h in q:
            served_head = h // (heads // served)
            assert served_head in local_kv
            assert served_head // r == h // (heads // kv_heads)  # same K/V as without tp


def test_replicate_kv_heads_repeats_whole_heads():
    config = tiny_random_config(num_heads=8, num_kv_heads=2, attention_bias=True)
    params = random_params(config)
    plan = plan_tensor_parallel(8, 2, 4)
    out = replicate_kv_heads(params, plan, config.head_dim)
    d = config.head_dim
    for name in ("k_proj", "v_proj"):
        for leaf in ("kernel", "bias"):
            before, after = params["layers"][name][leaf], out["layers"][name][leaf]
            assert after.shape[-1] == 4 * d
            for served in range(4):
                np.testing.assert_array_equal(
                    after[..., served * d : (served + 1) * d], before[..., (served // 2) * d : (served // 2 + 1) * d]
                )
    assert out["layers"]["q_proj"]["kernel"] is params["layers"]["q_proj"]["kernel"]
    on_device = replicate_kv_heads(jax.tree.map(jax.numpy.asarray, params), plan, d)
    np.testing.assert_array_equal(on_device["layers"]["k_proj"]["kernel"], out["layers"]["k_proj"]["kernel"])
    assert replicate_kv_heads(params, plan_tensor_parallel(8, 2, 2), d) is params


@pytest.mark.parametrize(
    "path, spec",
    [
        ("embed/embedding", P("tp", None)),
        ("lm_head/kernel", P(None, "tp")),
        ("layers/q_proj/kernel", P(None, None, "tp")),
        ("layers/k_proj/bias", P(None, "tp")),
        ("layers/up_proj/kernel", P(None, None, "tp")),
        ("layers/o_proj/kernel", P(None, "tp", None)),
        ("layers/down_proj/kernel", P(None, "tp", None)),
        ("layers/attn_norm/scale", P()),
        ("final_norm/scale", P()),
    ],
)
def test_rules(path, spec):
    weights = flat(declare(tiny_random_config(num_heads=8, attention_bias=True)))
    assert spec_for(path, weights[path].shape, TP4, weights[path]) == spec


def test_every_parameter_of_a_model_gets_a_sharding():
    config = tiny_random_config(num_heads=8, attention_bias=True)
    tree = param_shapes(config)
    shardings = param_shardings(tree, TP4, config)
    assert jax.tree.structure(shardings) == jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, tuple))
    assert shardings["layers"]["v_proj"]["bias"].spec == P(None, "tp")


def test_an_indivisible_dimension_is_replicated_with_a_warning(caplog):
    embedding = flat(declare(tiny_random_config(vocab_size=301)))["embed/embedding"]
    with caplog.at_level(logging.WARNING, logger="sharding.rules"):
        assert spec_for("embed/embedding", (301, 64), TP4, embedding) == P(None, None)
    assert "301 does not split 4 ways" in caplog.text


def test_an_undeclared_parameter_is_an_error():
    config = tiny_random_config()
    with pytest.raises(ValueError, match="parameter 'layers/rotary/freqs' is not declared by the llama architecture"):
        param_shardings({"layers": {"rotary": {"freqs": (4,)}}}, TP4, config)


@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_quantized_arrays_shard_like_their_kernels(mode):
    """Codes, scales and mins keep their kernel's logical axes: column-parallel kernels split on
    the output features, row-parallel ones on the input features (codes and groups of scales; a
    per-channel scale's single group is replicated)."""
    config = tiny_random_config(num_heads=8)
    tree = quantize_params(random_params(config), config, mode)
    shardings = param_shardings(tree, TP4, config, formats_of(tree))
    layers = shardings["layers"]
    names = ("kernel", "kernel_scale") + (("kernel_min",) if mode == "q4" else ())
    for name in names:
        assert layers["q_proj"][name].spec == layers["up_proj"][name].spec == P(None, None, "tp")
    assert layers["o_proj"]["kernel"].spec == P(None, "tp", None)
    row_parallel_scale = P() if mode == "int8" else P(None, "tp", None)
    assert layers["down_proj"]["kernel_scale"].spec == row_parallel_scale
    assert tree["layers"]["q_proj"]["kernel"].dtype == (np.int8 if mode == "int8" else np.uint8)
    # the output head [E, V] (int8 in groups of 32 in both modes), vocab-parallel like the float head
    assert shardings["lm_head"]["kernel"].spec == shardings["lm_head"]["kernel_scale"].spec == P(None, "tp")


@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_a_tied_table_quantized_as_the_head_splits_over_the_vocabulary(mode):
    config = tiny_random_config(num_heads=8, tie_word_embeddings=True, vocab_size=320)
    tree = quantize_params(random_params(config), config, mode)
    assert set(tree["embed"]) == {"kernel", "kernel_scale"} and tree["embed"]["kernel"].shape == (64, 320)
    shardings = param_shardings(tree, TP4, config, formats_of(tree))
    assert shardings["embed"]["kernel"].spec == shardings["embed"]["kernel_scale"].spec == P(None, "tp")
