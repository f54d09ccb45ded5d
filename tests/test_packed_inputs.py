"""Packed host inputs: a HostPack gives back, inside a jitted function, exactly the arrays it packed
(dtypes, shapes, bits), and one compiled signature serves every pack of the same shapes;
SamplingTensors' settings columns read and write the same bits on the host and in a jitted
function; a served engine runs its steps on packed arguments without compiling after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.model import AttentionMetadata
from jaxserve.runner.host_pack import HostPack
from jaxserve.sampling_tensors import RowSampling, SamplingTensors

_unpack = jax.jit(lambda pack: pack.unpack())


def _tree(rng: np.random.Generator, offset: int = 0) -> tuple:
    """Every packable dtype, 0-d to 2-d arrays, None fields, values at the edges of each dtype."""
    floats = np.array([0.0, -0.0, 1.5, -np.inf, np.inf, np.nan, 3.4e38, 1e-45], np.float32)
    seeds = np.array([[0xFFFFFFFF, 0x80000000], [0x80000001, 0], [1, 0x7FFFFFFF]], np.uint32)
    ints = np.array([np.iinfo(np.int32).min, -1, 0, np.iinfo(np.int32).max], np.int32)
    meta = AttentionMetadata(ints + offset, rng.integers(-5, 5, (3, 4), dtype=np.int32), np.arange(3, dtype=np.int32))
    return (ints, meta, {"floats": floats, "seeds": seeds, "mask": rng.random((2, 5)) < 0.5}, np.int32(7 + offset))


def _assert_same_bits(got, want) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(np.ravel(g).view(np.uint8), np.ravel(w).view(np.uint8))


def test_a_pack_unpacks_to_the_same_arrays_bit_for_bit():
    tree = _tree(np.random.default_rng(0))
    pack = HostPack.of(tree)
    assert pack.buffer.dtype == np.int32 and pack.buffer.ndim == 1  # one transfer
    _assert_same_bits(_unpack(pack), tree)


def test_packs_of_the_same_shapes_share_one_compiled_signature():
    rng = np.random.default_rng(1)
    compiled = _unpack.lower(HostPack.of(_tree(rng))).compile()
    other = _tree(rng, offset=3)  # other values, same shapes and dtypes
    _assert_same_bits(compiled(HostPack.of(other)), other)
    with pytest.raises(TypeError):  # another layout is another signature
        compiled(HostPack.of(_tree(rng)[:2]))


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.int8])
def test_a_dtype_that_does_not_fit_the_int32_words_is_refused(dtype):
    with pytest.raises(TypeError, match="HostPack takes"):
        HostPack.of((np.zeros(4, np.int32), np.zeros(4, dtype)))


SETTINGS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "positions",
    "num_logprobs",
    "penalty_rows",
)


def test_sampling_settings_are_columns_of_one_array_with_the_same_bits_in_jit():
    rows = [
        RowSampling(
            SamplingParams(
                temperature=0.7,
                top_k=5,
                top_p=0.9,
                min_p=0.05,
                presence_penalty=-0.5,
                frequency_penalty=0.25,
                repetition_penalty=1.3,
                logprobs=3,
                seed=1,
            ),
            seed=2**64 - 3,
            position=41,
            penalty_row=2,
        ),
        None,
        RowSampling(SamplingParams(temperature=0.0), seed=2**63 + 5, position=7),
    ]
    t = SamplingTensors.build(rows, 4, spare_row=9)
    assert t.settings.shape == (4, SamplingTensors.SETTING_WORDS) and t.settings.dtype == np.int32
    np.testing.assert_array_equal(t.seed, [[0xFFFFFFFF, 0xFFFFFFFD], [0, 0], [0x80000000, 5], [0, 0]])
    np.testing.assert_array_equal(t.temperature, np.float32([0.7, 0, 0, 0]))
    np.testing.assert_array_equal(t.penalty_rows, [2, 9, 9, 9])
    t.positions[1] = 99  # a setting is a view: writing it writes the settings array
    assert t.settings[1, SamplingTensors.positions.start] == 99
    host = {name: getattr(t, name) for name in SETTINGS}
    assert {name: a.dtype for name, a in host.items()} == {
        **dict.fromkeys(SETTINGS, np.dtype(np.float32)),
        "top_k": np.int32,
        "seed": np.uint32,
        "positions": np.int32,
        "num_logprobs": np.int32,
        "penalty_rows": np.int32,
    }
    _assert_same_bits(jax.jit(lambda t: {name: getattr(t, name) for name in SETTINGS})(t), host)
    moved = jax.jit(lambda t: t.at_positions(t.positions + 1))(t)
    np.testing.assert_array_equal(moved.positions, t.positions + 1)
    np.testing.assert_array_equal(
        np.delete(np.asarray(moved.settings), SamplingTensors.positions.start, axis=1),
        np.delete(t.settings, SamplingTensors.positions.start, axis=1),
    )


def test_settings_columns_do_not_overlap():
    columns = sorted((getattr(SamplingTensors, n).start, getattr(SamplingTensors, n).words) for n in SETTINGS)
    assert [start for start, _ in columns] == list(np.cumsum([0] + [w for _, w in columns])[:-1])
    assert sum(w for _, w in columns) == SamplingTensors.SETTING_WORDS


def test_an_engine_serves_on_packed_arguments_without_compiling_after_warm_up():
    llm = LLM(
        build_tiny_random(),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        block_size=8,
        num_blocks=200,
        decode_batch_buckets=(8,),
        block_table_buckets=(16,),
        prefill_token_buckets=(64,),
        prefill_seq_buckets=(4,),
    )
    runner = llm.engine.runner
    compiled = runner.num_compilations
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 250, int(n)).tolist()} for n in rng.integers(2, 40, 6)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=2**63 + 1, ignore_eos=True),
        SamplingParams(
            max_tokens=10,
            temperature=0.7,
            seed=5,
            presence_penalty=0.5,
            logit_bias={9: 2.0},
            min_tokens=4,
            logprobs=2,
            ignore_eos=True,
        ),
    ] * 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert runner.num_compilations == compiled
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 6
    # The steps read the packed buffer: a seeded request alone gives the tokens it gave among others.
    alone = llm.generate(prompts[1], params[1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
