"""Backend registry, the platform default, and how interpret mode is chosen."""

import jax
import pytest

from kernels_pallas import (
    BACKENDS,
    common,
    cpu_attention,
    cpu_build,
    decode,
    decode_mosaic,
    default_attention_backend,
    get_attention_backend,
    gpu_select,
    paged_jax,
    prefill,
    reference,
)


def test_registry():
    assert get_attention_backend("reference").decode is reference.decode_attention
    pallas = get_attention_backend("pallas")
    assert (pallas.decode, pallas.prefill) == (gpu_select.decode_attention, prefill.prefill_attention)
    triton = get_attention_backend("triton")
    assert (triton.decode, triton.prefill) == (decode.decode_attention, prefill.prefill_attention)
    mosaic = get_attention_backend("mosaic")
    assert (mosaic.decode, mosaic.prefill) == (decode_mosaic.decode_attention, prefill.prefill_attention)
    plain = get_attention_backend("jax")
    assert (plain.decode, plain.prefill) == (paged_jax.decode_attention, paged_jax.prefill_attention)
    native = get_attention_backend("cpu")
    assert (native.decode, native.prefill) == (cpu_attention.decode_attention, cpu_attention.prefill_attention)
    assert set(BACKENDS) == {"jax", "cpu", "reference", "pallas", "triton", "mosaic"}
    with pytest.raises(ValueError, match="jax, cpu, reference, pallas, triton, mosaic"):
        get_attention_backend("flash")


def test_default_backend_follows_the_platform(monkeypatch):
    platform = jax.default_backend()
    want = {"gpu": "pallas", "cpu": "cpu" if cpu_build.available() else "jax"}.get(platform, "jax")
    assert default_attention_backend() == want
    if platform == "cpu":  # no compiler for the C++ kernel: the plain-JAX one
        monkeypatch.setenv("CXX", "/nonexistent/c++")
        assert default_attention_backend() == "jax"


def test_interpret_resolution(monkeypatch):
    monkeypatch.delenv(common.INTERPRET_ENV, raising=False)
    assert common.resolve_interpret(None) == (jax.default_backend() == "cpu")
    monkeypatch.setenv(common.INTERPRET_ENV, "0")
    assert common.resolve_interpret(None) is False
    monkeypatch.setenv(common.INTERPRET_ENV, "1")
    assert common.resolve_interpret(None) is True
    assert common.resolve_interpret(False) is False  # an explicit flag wins over the variable


def test_native_shape_checks():
    common.check_native_shapes(64, 16, 128, interpret=False)
    common.check_native_shapes(80, 12, 8, interpret=True)  # the interpreter takes any shape
    with pytest.raises(ValueError, match="head_dim"):
        common.check_native_shapes(80, 16, 128, interpret=False)
    with pytest.raises(ValueError, match="block_size"):
        common.check_native_shapes(64, 12, 96, interpret=False)
    with pytest.raises(ValueError, match="tokens per step"):
        common.check_native_shapes(64, 8, 8, interpret=False)
