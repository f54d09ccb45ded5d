import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.sampler import TOP_K_FAST_MAX, _gumbel_noise, apply_penalties, sample, sampling_logits
from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_tensors import PenaltyCounts, RowSampling, SamplingTensors, penalty_history, set_penalty_rows

_jit_sample = jax.jit(sample, static_argnames="num_top_logprobs")
_sampling_logits = jax.jit(sampling_logits)
_apply_penalties = jax.jit(apply_penalties)
_set_penalty_rows = jax.jit(set_penalty_rows)

V = 1000  # not a multiple of the 256-token draw block, so block padding is exercised
B = 8  # most tests use this one batch shape (padding rows fill it) to keep compilations few
K = 5  # top log-probabilities asked of sample()
HISTORY = 8


@dataclasses.dataclass(frozen=True)
class Row:
    """A test row: its sampling settings and the request's tokens so far."""

    sampling: RowSampling
    prompt: tuple = ()
    output: tuple = ()


def _row(params: SamplingParams, seed: int = 0, position: int = 0, prompt=(), output=(), banned=()) -> Row:
    return Row(RowSampling(params, seed, position, tuple(banned)), tuple(prompt), tuple(output))


def _tensors(rows, batch: int = B) -> SamplingTensors:
    """Row i's penalty row is i (rows without penalties read the spare row, B)."""
    sampling = [None if r is None else dataclasses.replace(r.sampling, penalty_row=i) for i, r in enumerate(rows)]
    return SamplingTensors.build(sampling, batch, spare_row=batch)


def _counts(rows, batch: int = B, vocab: int = V) -> PenaltyCounts:
    """Penalty counts with row i set from row i's history, as the runner sets a new batch row's."""
    batch_rows = np.full(batch, -1, np.int32)
    history = np.full((batch, HISTORY), -1, np.int32)
    is_output = np.zeros((batch, HISTORY), np.bool_)
    for i, r in enumerate(rows):
        if r is not None and r.sampling.params.has_penalties:
            batch_rows[i] = i
            history[i], is_output[i] = penalty_history(r.prompt, r.output, r.sampling.params, HISTORY)
    return _set_penalty_rows(PenaltyCounts.zeros(batch, vocab), batch_rows, history, is_output)


def _sample(logits, rows, batch: int = B, k: int = K):
    counts = _counts(rows, batch, np.shape(logits)[1])
    out, _ = _jit_sample(logits, _tensors(rows, batch), counts, num_top_logprobs=k)
    return out


def _padded(logits: np.ndarray, batch: int = B) -> np.ndarray:
    """Logits for a [batch, V] call: the given rows, then random padding rows."""
    out = _random_logits(batch, seed=99)
    out[: len(logits), : logits.shape[1]] = logits
    out[: len(logits), logits.shape[1] :] = -100.0  # small examples: the rest is negligible
    return out


def _random_logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, vocab)) * scale).astype(np.float32)


def _kept(logits: np.ndarray, rows) -> np.ndarray:
    kept = np.isfinite(np.asarray(_sampling_logits(_padded(logits), _tensors(rows))))
    return kept[: len(logits), : logits.shape[1]]


def _reference_kept(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Sort-based top-k, then top-p on the renormalised survivors, then min-p (float64)."""
    x = x.astype(np.float64) / p.temperature
    keep = np.ones(x.shape, bool)
    if 0 < p.top_k < x.size:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    if p.top_p < 1.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        order = np.argsort(-x, kind="stable")
        boundary = np.searchsorted(np.cumsum(probs[order]), p.top_p)
        keep &= x >= x[order[boundary]]
    if p.min_p > 0.0:
        keep &= x >= x.max() + np.log(p.min_p)
    return keep


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = _random_logits(8)
    logits[3, [17, 500]] = logits[3].max() + 1.0  # a tie: the first index wins, like np.argmax
    rows = [_row(SamplingParams(temperature=0))] * 7 + [None]
    out = _sample(logits, rows, k=K)
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    assert int(out.tokens[3]) == 17


def test_greedy_applies_penalties_first() -> None:
    logits = np.zeros((2, V), np.float32)
    logits[:, 4], logits[:, 6] = 3.0, 2.0
    params = SamplingParams(temperature=0, repetition_penalty=2.0)  # 3.0 -> 1.5 < 2.0
    rows = [_row(params, output=[4]), _row(params, output=[1])]
    out = _sample(_padded(logits), rows, k=K)
    assert out.tokens[:2].tolist() == [6, 4]


def test_logit_bias_moves_only_its_rows_tokens_and_not_the_logprobs() -> None:
    logits = _random_logits(4, seed=21)
    top = logits.argmax(-1)
    rows = [
        _row(SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=0)),  # forces token 7
        _row(SamplingParams(temperature=0, logit_bias={int(top[1]): -100.0})),  # bans the argmax
        _row(SamplingParams(temperature=0)),  # no bias: untouched by its neighbours' biases
        _row(SamplingParams(temperature=1.0, logit_bias={3: 100.0, 9: 100.0}), seed=4),  # only 3 or 9 remain
    ]
    out = _sample(_padded(logits), rows, k=K)
    tokens = np.asarray(out.tokens)
    second = np.argsort(-logits[1])[1]
    assert tokens[0] == 7 and tokens[1] == second and tokens[2] == top[2] and tokens[3] in (3, 9)
    raw = logits[0].astype(np.float64)
    np.testing.assert_allclose(out.logprobs[0], raw[7] - np.log(np.exp(raw).sum()), atol=1e-5)  # unbiased


def test_banned_tokens_cannot_be_sampled_even_when_biased_up() -> None:
    logits = _random_logits(2, seed=22)
    top = logits.argmax(-1)
    rows = [
        _row(SamplingParams(temperature=0, logit_bias={int(top[0]): 50.0}), banned=[int(top[0])]),
        _row(SamplingParams(temperature=0), seed=3, banned=np.argsort(-logits[1])[:5].tolist()),
    ]
    tokens = np.asarray(_sample(_padded(logits), rows, k=K).tokens)
    assert tokens[0] == np.argsort(-logits[0])[1] and tokens[1] == np.argsort(-logits[1])[5]


def test_temperature_scales_logits() -> None:
    logits = _random_logits(2, 50)
    rows = [_row(SamplingParams(temperature=0.5)), _row(SamplingParams(temperature=2.0))]
    out = np.asarray(_sampling_logits(_padded(logits), _tensors(rows)))[:2, :50]
    np.testing.assert_allclose(out, logits / np.array([[0.5], [2.0]], np.float32), rtol=1e-6)


def test_top_k_keeps_exactly_k_on_both_paths() -> None:
    logits = _random_logits(4)
    ks = [1, 5, TOP_K_FAST_MAX, 300]  # the last forces the bisection path for the whole batch
    kept = _kept(logits, [_row(SamplingParams(top_k=k)) for k in ks])
    for row, k in enumerate(ks):
        expected = np.zeros(V, bool)
        expected[np.argsort(-logits[row])[:k]] = True
        np.testing.assert_array_equal(kept[row], expected)
    # Without the k=300 neighbour the others take the lax.top_k path: same sets.
    fast = _kept(logits[:3], [_row(SamplingParams(top_k=k)) for k in ks[:3]])
    np.testing.assert_array_equal(fast, kept[:3])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.array([0.05, 0.3, 0.5, 0.1, 0.04, 0.01])
    logits = np.log(probs).astype(np.float32)[None].repeat(5, 0)
    cases = [  # (top_p, top_k, kept token ids)
        (0.45, 0, {2}),
        (0.75, 0, {2, 1}),
        (0.85, 0, {2, 1, 3}),
        (0.55, 0, {2, 1}),
        (0.55, 2, {2}),  # top-k first: 0.5 / 0.8 = 0.625 already reaches 0.55
    ]
    kept = _kept(logits, [_row(SamplingParams(top_p=p, top_k=k)) for p, k, _ in cases])
    for row, (_, _, expected) in enumerate(cases):
        assert set(np.flatnonzero(kept[row])) == expected


def test_min_p_threshold_is_relative_to_the_top_probability() -> None:
    logits = np.array([[-1.0, 0.0, -3.0, -0.5, -2.0]] * 2, np.float32)
    rows = [
        _row(SamplingParams(min_p=float(np.exp(-1.5)))),
        _row(SamplingParams(min_p=float(np.exp(-1.5)), temperature=0.5)),  # scaled: 0,-1,-2,-4,-6
    ]
    kept = _kept(logits, rows)
    assert set(np.flatnonzero(kept[0])) == {0, 1, 3}
    assert set(np.flatnonzero(kept[1])) == {1, 3}


def test_truncation_matches_a_sort_based_reference() -> None:
    params = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.95),
        SamplingParams(temperature=1.3, top_p=0.5, top_k=40),
        SamplingParams(temperature=0.8, top_p=0.99, top_k=150),
        SamplingParams(temperature=1.0, top_k=7, min_p=0.3),
        SamplingParams(temperature=0.5, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=2.0, top_p=0.999),
        SamplingParams(temperature=1.0, top_k=999),
    ]
    logits = _random_logits(len(params), seed=3)
    logits[1] = -logits[1]  # mostly negative logits
    logits[2] += 40.0  # all positive
    kept = _kept(logits, [_row(p) for p in params])
    for row, p in enumerate(params):
        np.testing.assert_array_equal(kept[row], _reference_kept(logits[row], p), err_msg=str(p))


def test_penalties_follow_vllm_semantics() -> None:
    logits = np.linspace(-2.0, 2.5, V, dtype=np.float32)[None].repeat(B, 0)
    logits[:, 1], logits[:, 2] = 1.5, -1.0
    prompt, output = [1, 2, 2, 9], [2, 3, 3, 4]
    rows = [
        _row(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=prompt,
            output=output,
        ),
        _row(SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0), prompt=prompt, output=output),
        _row(SamplingParams(), prompt=prompt, output=output),  # no penalties: untouched
    ]
    got = np.asarray(_apply_penalties(logits, _tensors(rows), _counts(rows)))

    def expected(x, rep, freq, pres):
        x = x.copy()
        for tok in set(prompt + output):  # repetition: prompt and output tokens
            x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
        for tok in set(output):  # frequency and presence: output tokens only
            x[tok] -= freq * output.count(tok) + pres
        return x

    np.testing.assert_allclose(got[0], expected(logits[0], 2.0, 0.5, 0.25), rtol=1e-6)
    np.testing.assert_allclose(got[1], expected(logits[1], 1.0, -0.5, 1.0), rtol=1e-6)
    np.testing.assert_array_equal(got[2], logits[2])


def test_seeded_draws_depend_only_on_seed_and_position() -> None:
    logits = _random_logits(1, seed=7, scale=0.5)[0]  # flat: draws vary a lot
    target = SamplingParams(temperature=0.9, top_p=0.95)
    keys = [(seed, pos) for seed in (1, 2**40 + 1, 99) for pos in (0, 1, 57, 1000)]
    alone = [int(_sample(logits[None], [_row(target, s, pos)], 1, k=K).tokens[0]) for s, pos in keys]
    assert len(set(alone)) >= 6  # the stream really moves with seed and position
    neighbours = [  # every expensive path on, different logits beside each target
        SamplingParams(temperature=0),
        SamplingParams(top_k=300, top_p=0.5, repetition_penalty=1.3, presence_penalty=1.0),
        SamplingParams(temperature=1.5, min_p=0.2, logprobs=3),
    ]
    for row_of_target in (0, 5):
        rng = np.random.default_rng(row_of_target)
        for (s, pos), expected in zip(keys, alone):
            rows = [_row(neighbours[i % 3], seed=s, position=pos, output=[5, 6]) for i in range(B)]
            rows[row_of_target] = _row(target, s, pos)
            rows[-1] = None
            batch_logits = _random_logits(B, seed=int(rng.integers(1 << 30)))
            batch_logits[row_of_target] = logits
            out = _sample(batch_logits, rows, k=K)
            assert int(out.tokens[row_of_target]) == expected


def test_random_stream_is_fold_in_of_seed_and_position() -> None:
    streams = [(5, 0), (5, 3), (2**33 + 1, 3)]  # (seed, position)
    rows = [_row(SamplingParams(), seed=s, position=p) for s, p in streams]
    noise = np.asarray(_gumbel_noise(jax.device_put(_tensors(rows, 3)), 16))
    for (seed, position), got in zip(streams, noise):
        key = jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32), impl="threefry2x32")
        expected = jax.random.gumbel(jax.random.fold_in(key, position), (16,))
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(noise[0], jax.random.gumbel(jax.random.fold_in(jax.random.key(5), 0), (16,)))


def test_draws_follow_the_softmax_distribution() -> None:
    vocab, n = 600, 4096  # three draw blocks, the last one padded
    logits = np.full(vocab, -30.0, np.float32)
    hot = np.array([3, 100, 257, 300, 511, 599])
    logits[hot] = [0.0, 1.0, 0.5, -0.5, 0.2, -1.0]
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.7)):
        rows = [_row(params, seed=s, position=s % 13) for s in range(n)]
        out = _sample(np.broadcast_to(logits, (n, vocab)), rows, n, k=0)
        assert out.top_ids.shape == (n, 0)
        tokens = np.asarray(out.tokens)
        x = logits.astype(np.float64) / params.temperature
        keep = _reference_kept(logits, params)
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        freq = np.bincount(tokens, minlength=vocab) / n
        assert freq[~keep].sum() == 0.0
        # 5 standard deviations of a frequency over n draws is at most 5 * 0.5 / 64 = 0.039.
        np.testing.assert_allclose(freq[hot], probs[hot], atol=0.04)


def test_logprobs_come_from_the_raw_log_softmax() -> None:
    logits = _random_logits(B, seed=11)
    rows = [
        _row(
            SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.5, logprobs=5),
            seed=3,
            output=[int(logits[0].argmax())],
        ),
        _row(SamplingParams(temperature=0, logprobs=0)),
        None,
        _row(SamplingParams(temperature=1.2, min_p=0.1)),
    ]
    out = _sample(logits, rows, k=K)
    log_softmax = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, log_softmax[np.arange(B), tokens], atol=1e-5)
    top = np.argsort(-logits, axis=-1)[:, :K]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(log_softmax, top, 1), atol=1e-5)
    quiet = _sample(logits, [_row(SamplingParams(temperature=0))] * B, k=K)
    assert np.isnan(quiet.logprobs).all() and (np.asarray(quiet.top_ids) == -1).all()


def test_padding_rows_are_harmless() -> None:
    logits = _random_logits(B, seed=5)
    logits[1:] = np.nan  # whatever the runner leaves in padding rows
    real = _row(SamplingParams(temperature=0.8, top_p=0.9, logprobs=2), seed=1, position=4)
    alone = _sample(logits[:1], [real], 1, k=K)
    padded = _sample(logits, [real] + [None] * (B - 1), k=K)
    np.testing.assert_array_equal(alone.tokens, padded.tokens[:1])
    np.testing.assert_array_equal(alone.top_ids, padded.top_ids[:1])
    # XLA may sum a row in another order for another batch shape: equal up to rounding.
    np.testing.assert_allclose(alone.logprobs, padded.logprobs[:1], rtol=1e-6)
    np.testing.assert_allclose(alone.top_logprobs, padded.top_logprobs[:1], rtol=1e-6)
    assert ((np.asarray(padded.tokens) >= 0) & (np.asarray(padded.tokens) < V)).all()


def test_build_pads_and_encodes_rows() -> None:
    rows = [
        RowSampling(SamplingParams(temperature=0.5, top_k=-1, logprobs=3), seed=2**40 + 7, position=12),
        None,
        RowSampling(SamplingParams(repetition_penalty=1.2), seed=-1, position=0, penalty_row=3),
        RowSampling(SamplingParams(presence_penalty=0.5), seed=0, position=0, penalty_row=0),
    ]
    t = SamplingTensors.build(rows, batch_size=6, spare_row=9)
    np.testing.assert_array_equal(t.seed[0], [256, 7])
    np.testing.assert_array_equal(t.seed[2], [0xFFFFFFFF, 0xFFFFFFFF])  # seeds taken mod 2**64
    np.testing.assert_array_equal(t.temperature, [0.5, 0, 1, 1, 0, 0])  # padding is greedy
    np.testing.assert_array_equal(t.top_k, [0] * 6)
    np.testing.assert_array_equal(t.positions, [12, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(t.num_logprobs, [3, -1, -1, -1, -1, -1])
    np.testing.assert_allclose(t.repetition_penalty, [1, 1, 1.2, 1, 1, 1])
    np.testing.assert_array_equal(t.penalty_rows, [9, 9, 3, 0, 9, 9])  # no penalties: the spare
    assert (t.bias_ids == -1).all() and not t.bias_values.any()
    biased = SamplingTensors.build([None, RowSampling(SamplingParams(logit_bias={5: -2.5, 9: 1}), 0, 0)], 2, 2)
    np.testing.assert_array_equal(biased.bias_ids[:, :3], [[-1, -1, -1], [5, 9, -1]])
    np.testing.assert_array_equal(biased.bias_values[1, :3], [-2.5, 1, 0])
    with pytest.raises(ValueError, match="batch"):
        SamplingTensors.build([None] * 3, 2, 2)


def test_penalty_rows_are_set_from_history_and_count_what_is_sampled() -> None:
    rep, pres = SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5)
    history, is_output = zip(penalty_history([4, 5], [6, 6], rep, 4), penalty_history([4, 5], [6, 7], pres, 4))
    np.testing.assert_array_equal(history, [[4, 5, 6, 6], [6, 7, -1, -1]])  # the prompt only if repetition
    np.testing.assert_array_equal(is_output, [[False, False, True, True], [True, True, False, False]])
    with pytest.raises(ValueError, match="history"):
        penalty_history([], [1] * 5, rep, 4)
    counts = _set_penalty_rows(
        PenaltyCounts.zeros(3, 10),
        np.array([2, 0, -1, -1], np.int32),
        np.array(history + ([3, -1, -1, -1],) * 2, np.int32),
        np.array(is_output + (is_output[0],) * 2),
    )
    output, prompt = np.asarray(counts.output), np.asarray(counts.prompt)
    np.testing.assert_array_equal(output[2, [4, 5, 6, 7]], [0, 0, 2, 0])
    np.testing.assert_array_equal(np.flatnonzero(prompt[2]), [4, 5])
    np.testing.assert_array_equal(output[0, [6, 7]], [1, 1])
    assert not output[1].any() and not output[3].any() and not prompt[3].any()  # untouched, spare
    # sample() counts each penalised row's token in its penalty row, and nothing in the spare row
    rows = [RowSampling(SamplingParams(temperature=0, presence_penalty=0.5), 0, 0, penalty_row=1), None]
    logits = np.zeros((2, 10), np.float32)
    logits[:, 8] = 5.0
    out, counts = _jit_sample(logits, SamplingTensors.build(rows, 2, spare_row=3), counts, num_top_logprobs=0)
    assert list(np.asarray(out.tokens)) == [8, 8]
    assert np.asarray(counts.output)[1, 8] == 1 and not np.asarray(counts.output)[3].any()
