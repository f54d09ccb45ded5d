"""bfloat16 is refused on CPU with a message naming float32, and allowed elsewhere."""

import jax
import jax.numpy as jnp
import pytest

from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.model.llama import check_compute_dtype
from jaxserve.runner import ModelRunner


def test_bfloat16_refused_on_cpu_only():
    with pytest.raises(ValueError, match="--dtype float32"):
        check_compute_dtype(jnp.bfloat16, "cpu")
    check_compute_dtype(jnp.float32, "cpu")
    check_compute_dtype(jnp.bfloat16, "gpu")
    check_compute_dtype("bfloat16", "tpu")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the refusal is for CPU")
def test_engine_runner_refuses_bfloat16_on_cpu():
    model = load_model("tiny-random")
    with pytest.raises(ValueError, match="bfloat16 is not supported on CPU"):
        ModelRunner(model.config, model.params, EngineConfig(num_blocks=16, dtype="bfloat16"))
