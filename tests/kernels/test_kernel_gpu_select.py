"""The `pallas` backend's choice of decode kernel per GPU generation (kernels_pallas/gpu_select.py)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import LAYER, SCALE, block_tables, decode_lengths, make_cache, queries

from kernels_pallas import decode, decode_mosaic, gpu_select


@dataclasses.dataclass
class FakeDevice:
    platform: str
    compute_capability: str | None = None


def test_compute_capability():
    assert gpu_select.compute_capability(FakeDevice("gpu", "9.0")) == "9.0"
    assert gpu_select.compute_capability(FakeDevice("cpu")) is None
    assert gpu_select.compute_capability(FakeDevice("tpu")) is None


def test_mosaic_needs_hopper():
    assert gpu_select.mosaic_runs_on("9.0")
    for capability in ("8.0", "8.9", "10.0", "12.0", None):  # Ampere, Ada, Blackwell (no WGMMA), no GPU
        assert not gpu_select.mosaic_runs_on(capability)


def test_a_measured_pick_wins_only_where_its_kernel_runs():
    measured = {"9.0": "mosaic", "10.0": "mosaic", "8.0": "triton"}
    assert gpu_select.decode_kernel_for("9.0", measured) == "mosaic"
    assert gpu_select.decode_kernel_for("8.0", measured) == "triton"
    assert gpu_select.decode_kernel_for("10.0", measured) == "triton", "no WGMMA on Blackwell"
    assert gpu_select.decode_kernel_for("8.9", measured) == "triton", "unmeasured: Triton"
    assert gpu_select.decode_kernel_for(None, measured) == "triton"
    with pytest.raises(ValueError, match="triton, mosaic"):
        gpu_select.decode_kernel_for("9.0", {"9.0": "flash"})


def test_the_table_names_only_known_kernels():
    for capability, kernel in gpu_select.MEASURED.items():
        assert kernel in gpu_select.DECODE_KERNELS, capability


def _inputs(dtype):
    rng = np.random.default_rng(0)
    cache = make_cache(rng, 2, 16, 16, dtype)
    lengths = decode_lengths(rng, 16, 4)
    tables = block_tables(rng, lengths, 4, cache.num_blocks)
    return queries(rng, len(lengths), 8, dtype), cache.k, cache.v, jnp.int32(LAYER), tables, jnp.asarray(lengths)


@pytest.mark.parametrize(
    "dtype,expected", [(jnp.bfloat16, "mosaic"), (jnp.float32, "triton"), (jnp.int8, "triton"), (jnp.uint8, "triton")]
)
def test_dispatch_follows_the_pick_and_the_cache(monkeypatch, dtype, expected):
    """On a Hopper GPU measured for Mosaic, a bf16 cache goes to the Mosaic kernel and an f32 cache
    (which WGMMA cannot take) to Triton, as do int8 and fp8 (uint8) caches (`--kv-cache-dtype`); the
    kernels are stubbed with recorders, so no GPU is needed."""
    called = []
    monkeypatch.setattr(gpu_select, "compute_capability", lambda device=None: "9.0")
    monkeypatch.setattr(gpu_select, "MEASURED", {"9.0": "mosaic"})
    monkeypatch.setattr(decode, "decode_attention", lambda q, *a, **k: called.append("triton") or q)
    monkeypatch.setattr(decode_mosaic, "decode_attention", lambda q, *a, **k: called.append("mosaic") or q)
    q, *rest = _inputs(dtype)
    out = gpu_select.decode_attention(q, *rest, scale=SCALE)
    assert called == [expected] and out is q


def test_dispatch_on_this_machine_matches_the_triton_kernel():
    """Off a GPU (and on an unmeasured one) the `pallas` backend runs the Triton kernel."""
    if gpu_select.decode_kernel_for(gpu_select.compute_capability()) != "triton":
        pytest.skip("this GPU's measured pick is the Mosaic kernel")
    args = _inputs(jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(gpu_select.decode_attention(*args, scale=SCALE)),
        np.asarray(decode.decode_attention(*args, scale=SCALE)),
    )
