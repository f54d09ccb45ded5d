"""Weight-only quantization served end to end on the tiny model (`--quantization`).

An engine on quantized weights gives the greedy tokens of an f32 engine on the weights its codes
and scales dequantize to (the same function, so only f32 rounding differs): `q4` on the C++
kernels (the layers whose output features fill their panels) and the dequantize-then-dot of the
others, `int8` through XLA's path alone (the `jax` attention backend takes no C++ matmul; slow). Served
after warm-up it compiles nothing and leaves the KV pool free, and its weight bytes are those its
declaration says. A GGUF file's Q8_0 / Q5_0 / Q4_0 / Q4_1 blocks served as stored (the output head's too) give
the tokens of the same file dequantized to f32. The output head is quantized too (int8 in groups
of 32 under `int8` and `q4`); tests/test_quantized_head.py tests it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from checkpoints.architectures import declare
from checkpoints.params import iter_leaves
from checkpoints.quant_format import MIN, SCALE
from checkpoints.quantize import formats_of, quantize_params
from checkpoints.tiny_random import build_tiny_random
from checkpoints.weights import abstract, nest, quantized
from jaxserve import LLM, SamplingParams
from tests.checkpoints.ckpt_gguf_fixture import Q, write_tiny_gguf

ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    dtype="float32",
    decode_batch_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    sampler_row_buckets=(8,),
    block_table_buckets=(16,),
    num_blocks=128,
)
PROMPTS = [[3 + (7 * i + 5 * j) % 290 for j in range(n)] for i, n in enumerate((5, 17, 30, 70))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def dequantized(params: dict) -> dict:
    """The f32 parameters that a quantized tree stores (numpy: code * scale (+ min) per group)."""
    formats = formats_of(params)
    leaves = {}
    for path, leaf in iter_leaves(params):
        parent, name = path.rsplit("/", 1)
        if name in (SCALE, MIN):
            continue
        fmt = formats.get(path)
        if fmt is None:
            leaves[path] = np.asarray(leaf)
            continue
        codes = np.asarray(leaf)
        if fmt.bits == 4:
            codes = np.stack([codes & 15, codes >> 4], axis=-2).reshape(*codes.shape[:-2], -1, codes.shape[-1])
        arrays = leaves_of(params, parent)
        w = codes.astype(np.float32) * np.repeat(np.asarray(arrays[SCALE], np.float32), fmt.group, -2)
        if fmt.bits == 4:
            w += np.repeat(np.asarray(arrays[MIN], np.float32), fmt.group, -2)
        leaves[path] = w
    return nest(leaves)


def leaves_of(params: dict, path: str) -> dict:
    for key in path.split("/"):
        params = params[key]
    return params


@pytest.fixture(scope="module")
def model():
    return build_tiny_random()


@pytest.mark.parametrize(
    "mode, backend",
    [
        ("q4", "cpu"),
        # ~40 s: the XLA path is in CI through the layers the C++ kernel does not take (k/v here and below).
        pytest.param("int8", "jax", marks=pytest.mark.slow),
    ],
)
def test_quantized_engine_gives_the_tokens_of_its_dequantized_weights(model, mode, backend, assert_kv_all_free):
    llm = LLM(model, attention_backend=backend, quantization=mode, warm_up=mode == "q4", **ENGINE)
    runner = llm.engine.runner
    compiled = runner.num_compilations
    got = tokens(llm)
    if mode == "q4":  # warmed up: serving compiles nothing
        assert runner.num_compilations == compiled
    assert_kv_all_free(llm.engine)
    formats = runner.quantization
    assert set(formats) == {
        f"layers/{n}/kernel" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    } | {"lm_head/kernel"}
    assert (formats["lm_head/kernel"].bits, formats["lm_head/kernel"].group) == (8, 32)  # the head: int8 in q4 too
    declared = abstract(quantized(declare(runner.config), formats), np.float32)
    assert runner.weight_bytes == sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(declared))
    assert runner.weight_bytes < (0.6 if mode == "int8" else 0.5) * sum(a.nbytes for a in jax.tree.leaves(model.params))
    twin = dataclasses.replace(model, params=dequantized(quantize_params(model.params, model.config, mode)))
    reference = LLM(twin, attention_backend=backend, warm_up=False, **ENGINE)
    assert got == tokens(reference)


def test_gguf_blocks_served_as_stored_give_the_tokens_of_the_dequantized_file(model, tmp_path):
    path = tmp_path / "tiny.gguf"
    types = {
        "attn_q.weight": Q.Q4_0,
        "attn_k.weight": Q.Q4_1,
        "attn_v.weight": Q.Q5_0,  # as int8 codes, exactly
        "attn_output.weight": Q.Q4_0,
        "ffn_gate.weight": Q.Q8_0,
        "ffn_up.weight": Q.Q4_1,
        "ffn_down.weight": Q.F16,  # F16: dequantized
        "output.weight": Q.Q4_1,
    }
    write_tiny_gguf(path, model, types=types)
    served = LLM(str(path), quantization="gguf", warm_up=False, **ENGINE)
    formats = {path: (fmt.bits, fmt.group) for path, fmt in served.engine.runner.quantization.items()}
    assert formats == {
        "layers/q_proj/kernel": (4, 32),
        "layers/k_proj/kernel": (4, 32),
        "layers/v_proj/kernel": (8, 32),
        "layers/o_proj/kernel": (4, 32),
        "layers/gate_proj/kernel": (8, 32),
        "layers/up_proj/kernel": (4, 32),
        "lm_head/kernel": (4, 32),
    }
    assert served.engine.runner.params["layers"]["down_proj"]["kernel"].dtype == np.float32
    assert tokens(served) == tokens(LLM(str(path), warm_up=False, **ENGINE))


def test_quantization_auto_serves_a_gguf_files_blocks_on_the_cpu_kernels(model, tmp_path, caplog):
    """`quantization="auto"` (the command line's default) serves a GGUF file's blocks as stored where the
    C++ CPU kernels read them, and full-precision weights otherwise (a model that is not a GGUF file, a
    file whose kernels are mostly in other types, another attention backend, several devices, unrolled
    layers); logged; a given mode is kept."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine_args import add_engine_args
    from jaxserve.quantization_choice import choose_quantization, weights_quantization
    from jaxserve.speculative.config import SpeculativeConfig
    from kernels_pallas import cpu_build

    if jax.default_backend() != "cpu" or not cpu_build.available():
        pytest.skip("auto picks gguf only on the C++ CPU kernels")
    path = tmp_path / "tiny.gguf"
    types = {"attn_q.weight": Q.Q4_1, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.F16, "output.weight": Q.Q4_0}
    write_tiny_gguf(path, model, types=types)
    with caplog.at_level("INFO", logger="jaxserve.quantization_choice"):
        auto = LLM(str(path), quantization="auto", attention_backend="cpu", warm_up=False, **ENGINE)
    assert "quantization auto: gguf" in caplog.text
    assert auto.engine.config.quantization == "gguf"
    assert {p: (f.bits, f.group) for p, f in auto.engine.runner.quantization.items()} == {
        "layers/q_proj/kernel": (4, 32),
        "layers/k_proj/kernel": (4, 32),
        "layers/gate_proj/kernel": (8, 32),
        "layers/up_proj/kernel": (8, 32),
        "lm_head/kernel": (4, 32),
    }
    # (the blocks' tokens: test_gguf_blocks_served_as_stored_give_the_tokens_of_the_dequantized_file)

    asked = EngineConfig(num_blocks=16, quantization="auto", attention_backend="cpu")
    assert weights_quantization(asked, "smollm2-135m-instruct") == "gguf"  # a registry model is a GGUF file
    assert weights_quantization(asked, "tiny-random") == "none"
    assert weights_quantization(asked, str(tmp_path)) == "none"  # a directory: full precision
    assert weights_quantization(asked, model) == "none"  # loaded by the caller
    for other in (
        dict(attention_backend="jax"),
        dict(tensor_parallel_size=2),
        dict(pipeline_parallel_size=2),
        dict(unroll_layers=True),
        dict(speculative_config=SpeculativeConfig("mtp", 2)),
        dict(speculative_config=SpeculativeConfig("eagle3", 2, model=str(tmp_path))),
    ):
        assert choose_quantization(dataclasses.replace(asked, **other), str(path))[0] == "none", other
    assert weights_quantization(dataclasses.replace(asked, quantization="none"), str(path)) == "none"
    full = tmp_path / "f16.gguf"  # no kernel in a type the kernels read: dequantized at every start
    write_tiny_gguf(full, model, types={name: Q.F16 for name in types} | {"attn_k.weight": Q.Q4_1})
    mode, why = choose_quantization(asked, str(full))
    assert mode == "none" and "of the file's layer weights are in types the kernels read" in why, why
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).quantization == "auto"
