"""Backends wrapped in shard_map over kv heads equal the unsharded reference (4 CPU devices)."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas import common, get_attention_backend, shard_attention

HERE = pathlib.Path(__file__).parent


def test_sharded_backends_match_reference():
    """tp=4 (one kv head per device) and dp=2 x tp=2 (replicated over dp), in one subprocess;
    with attention sinks split with the heads too."""
    # Simulated devices exist on the CPU platform only, where Pallas runs interpreted.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", common.INTERPRET_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "sharded_worker.py"), "1x4", "2x2"],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 6, proc.stdout


def test_rejects_a_mesh_without_the_axis():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "model"))
    with pytest.raises(ValueError, match="'tp'"):
        shard_attention(get_attention_backend("reference"), mesh)
