"""bench/accuracy.py: compare() and the windows on hand-made scores; score_text against the
engine's own prompt scores; bf16 weights, int8 and fp8 KV caches against f32 on the default model
over real text; the
`jaxserve bench accuracy` command on the tiny random model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.accuracy import TextScores, compare, score_text, windows
from bench.accuracy_run import engine_namespace
from bench.heldout_text import first_tokens, python_docs_text
from jaxserve import LLM, SamplingParams
from jaxserve.engine_args import add_engine_args


def scores(ids, logprobs, top1) -> TextScores:
    return TextScores(tuple(ids), np.asarray(logprobs, np.float64), np.asarray(top1, np.int64))


# ----- hand-made scores ------------------------------------------------------------------------


def test_compare_counts_top1_agreement_perplexities_and_the_first_divergence():
    ids = [5, 6, 7, 8, 9]
    ref = scores(ids, [-1.0, -2.0, -0.5, -0.5], [6, 7, 8, 9])
    cand = scores(ids, [-1.0, -2.5, -0.5, -1.0], [6, 3, 8, 4])
    a = compare(ref, cand)
    assert a.positions == 4
    assert a.top1_agreement == 0.5
    assert a.first_divergence == 1
    assert a.reference_perplexity == pytest.approx(math.exp(4.0 / 4))
    assert a.candidate_perplexity == pytest.approx(math.exp(5.0 / 4))
    assert a.perplexity_ratio == pytest.approx(math.exp(0.25))
    assert a.mean_abs_logprob_diff == pytest.approx(1.0 / 4)


def test_compare_of_identical_scores_agrees_everywhere():
    ref = scores([1, 2, 3], [-0.1, -3.0], [2, 9])
    a = compare(ref, ref)
    assert (a.top1_agreement, a.perplexity_ratio, a.first_divergence, a.mean_abs_logprob_diff) == (1.0, 1.0, None, 0.0)


def test_compare_refuses_different_texts_and_empty_scores():
    with pytest.raises(ValueError, match="different token"):
        compare(scores([1, 2], [-1.0], [2]), scores([1, 3], [-1.0], [3]))
    with pytest.raises(ValueError, match="nothing was scored"):
        compare(scores([1], [], []), scores([1], [], []))


def test_scores_must_have_one_entry_per_next_token():
    with pytest.raises(ValueError, match="3 tokens need 2 scores"):
        scores([1, 2, 3], [-1.0], [2])


@pytest.mark.parametrize(
    "n, window, want",
    [
        (10, 4, [(0, 4), (3, 7), (6, 10)]),
        (11, 4, [(0, 4), (3, 7), (6, 10), (9, 11)]),
        (3, 8, [(0, 3)]),
        (1, 8, []),
    ],
)
def test_windows_overlap_by_one_so_each_target_is_scored_once(n, window, want):
    spans = windows(n, window)
    assert spans == want
    targets = [t for a, b in spans for t in range(a + 1, b)]
    assert targets == list(range(1, n))


def test_engine_namespace_applies_flags_over_the_shared_ones():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    base = parser.parse_args(["--max-model-len", "256", "--dtype", "float32"])
    cand = engine_namespace(base, "--dtype bfloat16 --max-num-seqs 3")
    assert (cand.dtype, cand.max_num_seqs, cand.max_model_len) == ("bfloat16", 3, 256)
    assert base.dtype == "float32" and base.max_num_seqs == 64  # the base is left alone
    with pytest.raises(SystemExit):
        engine_namespace(base, "--no-such-flag 1")


# ----- the engine -------------------------------------------------------------------------------

TINY = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=64,
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
)


def test_score_text_equals_the_engines_prompt_scores_of_each_window():
    llm = LLM("tiny-random", warm_up=False, **TINY)
    ids = np.random.default_rng(0).integers(3, 250, 150).tolist()
    got = score_text(llm, ids, window=40)
    assert got.num_positions == 149
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    ranks = []
    for a, b in windows(150, 40):  # each window alone
        want = llm.generate([{"prompt_token_ids": ids[a:b]}], params, use_tqdm=False)[0].prompt_logprobs[1:]
        np.testing.assert_array_equal(got.logprobs[a : b - 1], [s.logprob for s in want])
        np.testing.assert_array_equal(got.top1[a : b - 1], [s.top[0][0] for s in want])
        ranks += [s.rank for s in want]
    # the actual token is the top-1 exactly where the engine ranks it first
    np.testing.assert_array_equal(got.top1 == np.asarray(ids[1:]), np.asarray(ranks) == 1)


@pytest.mark.slow  # ~20 s of CPU: two warmed-up engines; its parts are tested above and below in CI
def test_bench_accuracy_command_writes_the_table_and_json(tmp_path, capsys):
    from jaxserve.cli import build_parser

    out = tmp_path / "acc.json"
    text = tmp_path / "t.txt"
    text.write_text(python_docs_text()[:4000])
    flags = [
        x
        for k, v in TINY.items()
        for x in (f"--{k.replace('_', '-')}", *([str(e) for e in v] if isinstance(v, tuple) else [str(v)]))
    ]
    args = build_parser().parse_args(
        [
            "bench",
            "accuracy",
            "--model",
            "tiny-random",
            "--positions",
            "100",
            "--text-file",
            str(text),
            *flags,
            "--candidate-args=--dtype bfloat16",
            "--result-file",
            str(out),
        ]
    )
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["positions"] == 100 and [r["mode"] for r in rows] == [
        "--dtype float32 --quantization none",
        "--dtype bfloat16",
    ]
    assert rows[0]["top1_agreement"] == 1.0 and 0.5 < rows[1]["top1_agreement"] <= 1.0
    assert rows[1]["weight_bytes"] < 0.6 * rows[0]["weight_bytes"]
    # `--kv-cache-dtype auto` is the weights' dtype: bf16 weights keep a bf16 cache, twice the tokens per GiB.
    assert rows[1]["kv_tokens_per_gib"] == 2 * rows[0]["kv_tokens_per_gib"] > 0
    assert "top-1 agree" in capsys.readouterr().out


# ----- bf16 against f32 on the default model ----------------------------------------------------

POSITIONS = 2040  # 2 windows of 1,021 targets each
REAL = dict(
    max_num_seqs=2,
    max_num_batched_tokens=512,
    max_model_len=1024,
    prefill_token_buckets=(512,),
    prefill_seq_buckets=(2,),
    decode_batch_buckets=(2,),
    sampler_row_buckets=(2,),
    block_table_buckets=(64,),
    num_blocks=160,
)
MIN_TOP1_AGREEMENT = 0.98
MAX_PERPLEXITY_CHANGE = 0.01


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    from bench.model_files import load_tokenizer
    from checkpoints.registry import DEFAULT_MODEL

    return first_tokens(load_tokenizer(DEFAULT_MODEL), python_docs_text(), POSITIONS + 1)


def _scores(dtype: str, ids: list[int], **engine) -> TextScores:
    llm = LLM(dtype=dtype, warm_up=False, **REAL, **engine)  # compiles the three programs scoring runs, no more
    return score_text(llm, ids)


@pytest.fixture(scope="module")
def f32_scores(text_ids) -> TextScores:
    return _scores("float32", text_ids)


@pytest.mark.integration
def test_bfloat16_agrees_with_float32_on_real_text(text_ids, f32_scores, capsys):
    f32 = f32_scores
    bf16 = _scores("bfloat16", text_ids)
    a = compare(f32, bf16)
    with capsys.disabled():
        print(
            f"\nbf16 vs f32 over {a.positions} positions: top-1 {a.top1_agreement:.4f}, perplexity "
            f"{a.reference_perplexity:.3f} -> {a.candidate_perplexity:.3f} ({a.perplexity_ratio:.4f}), "
            f"first divergence {a.first_divergence}, mean |dlogp| {a.mean_abs_logprob_diff:.4f}"
        )
    assert a.positions == POSITIONS
    assert 5 < a.reference_perplexity < 60  # the f32 model reads English (~20 on this text)
    assert a.top1_agreement >= MIN_TOP1_AGREEMENT
    assert abs(a.perplexity_ratio - 1) <= MAX_PERPLEXITY_CHANGE
    assert a.top1_agreement < 1 or a.mean_abs_logprob_diff > 0  # bf16 rounding shows somewhere


# KV caches of int8 and fp8 (f32 weights), measured 2026-12-06 over these 2,040 positions (docs/performance.md,
# "KV cache precision"): int8 top-1 0.9819, perplexity x1.0005; fp8 (e4m3, 3 mantissa bits) 0.9657, x1.0061.
KV_MIN_TOP1_AGREEMENT = {"int8": 0.97, "fp8": 0.95}
KV_MAX_PERPLEXITY_CHANGE = 0.01


@pytest.mark.integration
@pytest.mark.parametrize("kv", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])  # fp8's reads: kernel tests
def test_int8_and_fp8_kv_caches_agree_with_float32_on_real_text(kv, text_ids, f32_scores, capsys):
    a = compare(f32_scores, _scores("float32", text_ids, kv_cache_dtype=kv))
    with capsys.disabled():
        print(
            f"\n{kv} KV vs f32 over {a.positions} positions: top-1 {a.top1_agreement:.4f}, perplexity "
            f"{a.reference_perplexity:.3f} -> {a.candidate_perplexity:.3f} ({a.perplexity_ratio:.4f}), "
            f"mean |dlogp| {a.mean_abs_logprob_diff:.4f}"
        )
    assert a.positions == POSITIONS
    assert a.top1_agreement >= KV_MIN_TOP1_AGREEMENT[kv]
    assert abs(a.perplexity_ratio - 1) <= KV_MAX_PERPLEXITY_CHANGE
    assert a.mean_abs_logprob_diff > 0  # the cache really was quantized


def test_first_tokens_are_those_of_the_whole_text():
    from bench.model_files import load_tokenizer

    tokenizer = load_tokenizer("tiny-random")
    text = python_docs_text()[:20000]
    whole = tokenizer.encode(text)
    assert first_tokens(tokenizer, text, 300) == whole[:300]
    assert first_tokens(tokenizer, text[:500], 10**6) == tokenizer.encode(text[:500])  # all there is
