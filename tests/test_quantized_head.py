"""The output head under weight-only quantization (`--quantization`): a tied embedding table stored
as the head's kernel [E, V] (int8 in groups of 32 hidden features, in `int8` and `q4` alike), read
by the quantized matmul (the C++ kernel where its panels take the vocabulary), its lookup
dequantizing only the rows it gathers; an untied head quantized as a kernel; a GGUF file's head
served as stored, or quantized at load where its type is not one kept as stored."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.architectures import declare
from checkpoints.quant_format import QuantFormat
from checkpoints.quantize import HEAD_INT8_GROUP, formats_for, quantize_kernel, quantize_params
from checkpoints.tiny_random import build_tiny_random, tiny_random_config
from checkpoints.weights import abstract, quantized
from jaxserve import LLM
from jaxserve.model.quantized import columns, stored_matmul
from kernels_pallas import cpu_build, cpu_qmatmul
from kernels_pallas.cpu_matmul import to_panels
from tests.checkpoints.ckpt_gguf_fixture import Q, write_tiny_gguf
from tests.kernels.test_kernel_cpu_qmatmul import reference_dequantize
from tests.test_quantization import ENGINE, tokens

needs_kernel = pytest.mark.skipif(not cpu_build.available(), reason="no C++ compiler")
FORMATS = [QuantFormat(8, HEAD_INT8_GROUP), QuantFormat(4, 32)]


def head_arrays(fmt: QuantFormat, vocab: int = 640, hidden: int = 128, seed: int = 0):
    """A random table [V, E] and its quantized head kernel's arrays (quantized from its transpose)."""
    table = np.random.default_rng(seed).standard_normal((vocab, hidden), np.float32)
    return table, {name: np.asarray(a) for name, a in quantize_kernel(jnp.asarray(table.T), fmt).items()}


def panels(arrays: dict) -> dict:
    return {name: to_panels(jnp.asarray(a)[None], cpu_qmatmul.panel_width()) for name, a in arrays.items()}


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("layout", ["panels", "kernel"])
def test_lookup_is_the_dequantized_rows_it_gathers(fmt, layout):
    table, arrays = head_arrays(fmt)
    stored = panels(arrays) if layout == "panels" else arrays
    ids = jnp.asarray([0, 5, 63, 64, 639, 5, 300], jnp.int32)
    got = np.asarray(jax.jit(columns, static_argnums=(2,))(stored, ids, jnp.float32))
    want = reference_dequantize(arrays, fmt).T[np.asarray(ids)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got - table[np.asarray(ids)]).max() < 0.1 * np.abs(table).max()


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("layout", ["panels", "kernel"])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_head_logits_are_its_dequantized_kernels_and_close_to_the_f32_heads(fmt, layout, rows):
    table, arrays = head_arrays(fmt)
    stored = panels(arrays) if layout == "panels" else arrays
    x = np.random.default_rng(rows).standard_normal((rows, table.shape[1]), np.float32)
    got = np.asarray(jax.jit(lambda x, a: stored_matmul(x, a, None, jnp.float32))(x, stored))
    exact = x.astype(np.float64) @ reference_dequantize(arrays, fmt)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    f32 = x @ table.T
    error = np.abs(got - f32).max()
    assert error < (0.01 if fmt.bits == 8 else 0.1) * np.abs(f32).max()
    # the token it ranks first is the f32 head's first or within the error of it (random rows tie closely)
    chosen = np.take_along_axis(f32, got.argmax(-1)[:, None], -1)[:, 0]
    assert np.all(chosen >= f32.max(-1) - 2 * error)


@pytest.fixture(scope="module")
def tied():
    """The tiny model with its embedding tied to the head, over 5 panels' worth of vocabulary."""
    return build_tiny_random(tie_word_embeddings=True, vocab_size=320, seed=3)


def dequantized_head(model, mode: str):
    """The model's f32 parameters with the table its quantized head stores (the layers unchanged)."""
    q = quantize_params(model.params, model.config, mode, only=("embed/kernel",))
    fmt = QuantFormat(8, HEAD_INT8_GROUP)
    table = reference_dequantize({name: np.asarray(a) for name, a in q["embed"].items()}, fmt).T
    return dataclasses.replace(model, params={**model.params, "embed": {"embedding": table.astype(np.float32)}})


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_tied_head_is_quantized_in_panels_and_counted_in_the_weight_bytes(tied, mode):
    llm = LLM(tied, attention_backend="cpu", quantization=mode, warm_up=False, **ENGINE)
    runner = llm.engine.runner
    fmt = runner.quantization["embed/kernel"]
    assert (fmt.bits, fmt.group) == (8, HEAD_INT8_GROUP)
    embed = runner.params["embed"]
    assert "embedding" not in embed  # no float table kept
    panel = cpu_qmatmul.panel_width()
    assert embed["kernel"].shape == (1, 320 // panel, 64, panel) and embed["kernel"].dtype == np.int8
    declared = abstract(quantized(declare(runner.config), runner.quantization), np.float32)
    assert runner.weight_bytes == sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(declared))
    head_bytes = sum(a.nbytes for a in jax.tree.leaves(embed))
    assert head_bytes == 320 * 64 * (1 + 4 / HEAD_INT8_GROUP)  # a code a weight, an f32 scale per 32
    assert head_bytes < 0.3 * tied.params["embed"]["embedding"].nbytes
    if mode == "q4":  # the layers as q4, the head as int8: the tokens of the f32 head on the table it stores
        got = tokens(llm)
        twin = dequantized_head(tied, mode)
        reference = LLM(
            dataclasses.replace(twin, params=quantize_params(twin.params, twin.config, mode)),
            attention_backend="cpu",
            warm_up=False,
            **ENGINE,
        )
        assert got == tokens(reference)


def test_gguf_tied_table_served_as_stored_and_an_untied_float_head_quantized_at_load(tied, tmp_path, caplog):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied, types={"token_embd.weight": Q.Q8_0, "ffn_down.weight": Q.F32})
    served = LLM(str(path), quantization="gguf", warm_up=False, **ENGINE)
    fmt = served.engine.runner.quantization["embed/kernel"]
    assert (fmt.bits, fmt.group) == (8, 32)
    assert tokens(served) == tokens(LLM(str(path), warm_up=False, **ENGINE))

    untied = tmp_path / "untied.gguf"
    write_tiny_gguf(untied, build_tiny_random(), types={"output.weight": Q.F16, "ffn_down.weight": Q.F32})
    with caplog.at_level(logging.INFO, logger="checkpoints.quantize"):
        runner = LLM(str(untied), quantization="gguf", warm_up=False, **ENGINE).engine.runner
    fmt = runner.quantization["lm_head/kernel"]
    assert (fmt.bits, fmt.group) == (8, HEAD_INT8_GROUP)
    assert "quantized from the loaded values" in caplog.text


def test_a_head_whose_hidden_size_does_not_split_in_groups_gets_a_scale_per_token():
    config = tiny_random_config(hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    for mode in ("int8", "q4"):
        fmt = formats_for(config, mode)["embed/kernel"]
        assert (fmt.bits, fmt.group) == (8, 48)
