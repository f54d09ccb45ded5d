"""Converted (orbax) checkpoints: round trips, sharded restore, convert(), errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from ckpt_gguf_fixture import hf_weights, write_tiny_gguf

from checkpoints.errors import CheckpointError
from checkpoints.hf import save_hf_dir
from checkpoints.orbax_io import MANIFEST, is_orbax_dir, load_orbax, save_orbax
from checkpoints.params import iter_leaves
from checkpoints.registry import convert
from checkpoints.tiny_random import build_tiny_random


def assert_same_params(a, b):
    leaves_a, leaves_b = dict(iter_leaves(a)), dict(iter_leaves(b))
    assert sorted(leaves_a) == sorted(leaves_b)
    for path, value in leaves_a.items():
        np.testing.assert_array_equal(np.asarray(leaves_b[path]), value, err_msg=path)


def test_round_trip(tmp_path):
    model = build_tiny_random()
    save_orbax(model, tmp_path / "ckpt")
    assert is_orbax_dir(tmp_path / "ckpt")
    loaded = load_orbax(tmp_path / "ckpt")
    assert loaded.config == model.config
    assert all(type(leaf) is np.ndarray for _, leaf in iter_leaves(loaded.params))
    assert_same_params(model.params, loaded.params)
    bundle, original = loaded.tokenizer_bundle, model.tokenizer_bundle
    assert bundle.tokenizer.to_str() == original.tokenizer.to_str()
    assert (bundle.chat_template, bundle.special_tokens, bundle.eos_token_ids) == (
        original.chat_template,
        original.special_tokens,
        original.eos_token_ids,
    )


def test_restore_casts_dtype(tmp_path):
    model = build_tiny_random()
    save_orbax(model, tmp_path / "ckpt")
    loaded = load_orbax(tmp_path / "ckpt", dtype="bfloat16")
    embedding = loaded.params["embed"]["embedding"]
    assert embedding.dtype.name == "bfloat16"
    np.testing.assert_allclose(embedding.astype(np.float32), model.params["embed"]["embedding"], rtol=1e-2)


def test_restore_into_shardings(tmp_path):
    model = build_tiny_random()
    save_orbax(model, tmp_path / "ckpt")
    device = jax.devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), model.params)
    loaded = load_orbax(tmp_path / "ckpt", shardings=shardings)
    for _, leaf in iter_leaves(loaded.params):
        assert isinstance(leaf, jax.Array) and leaf.sharding == jax.sharding.SingleDeviceSharding(device)
    assert_same_params(model.params, loaded.params)


_SHARDED_RESTORE = """
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from checkpoints.orbax_io import load_orbax
from checkpoints.params import iter_leaves
from checkpoints.tiny_random import build_tiny_random

mesh = Mesh(np.array(jax.devices()).reshape(1, 4), ("dp", "tp"))
reference = build_tiny_random().params
# Kernels split on their output axis over "tp" (as tensor parallelism will), the rest replicated.
spec_of = lambda x: NamedSharding(mesh, P(None, None, "tp") if x.ndim == 3 else P())
shardings = jax.tree.map(spec_of, reference)
restored = dict(iter_leaves(load_orbax(sys.argv[1], shardings=shardings).params))
for path, want in iter_leaves(reference):
    leaf = restored[path]
    assert leaf.sharding == spec_of(want), path
    for shard in leaf.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=path)
    if want.ndim == 3:
        assert leaf.addressable_shards[0].data.shape[-1] == want.shape[-1] // 4, path
print("ok", len(restored))
"""


def test_restore_into_mesh_shards(tmp_path):
    """Each of 4 (CPU) devices receives exactly its slice of every sharded parameter."""
    save_orbax(build_tiny_random(), tmp_path / "ckpt")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_RESTORE, str(tmp_path / "ckpt")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_convert_hf_dir(tmp_path, capsys):
    model = build_tiny_random()
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, tmp_path / "hf")
    times = convert(str(tmp_path / "hf"), tmp_path / "converted")
    assert times.source_load_s > 0 and times.converted_load_s > 0
    assert "converted checkpoint" in capsys.readouterr().out
    assert_same_params(model.params, load_orbax(tmp_path / "converted").params)
    with pytest.raises(FileExistsError):
        convert(str(tmp_path / "hf"), tmp_path / "converted")


def test_convert_gguf(tmp_path):
    model = build_tiny_random(intermediate_size=256)
    expected = write_tiny_gguf(tmp_path / "m.gguf", model)
    convert(str(tmp_path / "m.gguf"), tmp_path / "converted", log=lambda _: None)
    converted = load_orbax(tmp_path / "converted")
    got = hf_weights(converted)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert converted.tokenizer_bundle.chat_template == model.tokenizer_bundle.chat_template


def test_not_a_converted_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="converted checkpoint not found"):
        load_orbax(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"no {MANIFEST}"):
        load_orbax(tmp_path)


def test_corrupted_checkpoint(tmp_path):
    save_orbax(build_tiny_random(), tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        load_orbax(tmp_path / "ckpt")
    manifest.write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_orbax(tmp_path / "ckpt")


def test_missing_params(tmp_path):
    save_orbax(build_tiny_random(), tmp_path / "ckpt")
    for path in sorted((tmp_path / "ckpt" / "params").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (tmp_path / "ckpt" / "params").rmdir()
    with pytest.raises(CheckpointError, match="cannot restore parameters"):
        load_orbax(tmp_path / "ckpt")


def test_truncated_array_data(tmp_path):
    save_orbax(build_tiny_random(), tmp_path / "ckpt")
    largest = max((p for p in (tmp_path / "ckpt" / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    # In a subprocess: after a failed read, orbax's other pending reads call back into an event
    # loop it has closed, and those ignored errors would surface in whichever test runs next.
    code = (
        "import sys\nfrom checkpoints.orbax_io import load_orbax\nfrom checkpoints.errors import CheckpointError\n"
        "try:\n    load_orbax(sys.argv[1])\nexcept CheckpointError as e:\n    print('CheckpointError:', e)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")], env=env, capture_output=True, text=True
    )
    assert "CheckpointError:" in result.stdout and "cannot restore parameters" in result.stdout, result.stderr[-2000:]
