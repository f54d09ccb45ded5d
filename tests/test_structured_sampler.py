"""The structured-output token mask inside the on-device sampler: a packed bitmask that forbids
all but a set of tokens lets only those be sampled (greedy and seeded), rows without a mask are
untouched, and a batch built without masks never applies one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.sampler import sample
from jaxserve.sampling_params import SamplingParams
from jaxserve.sampling_tensors import PenaltyCounts, RowSampling, SamplingTensors
from jaxserve.structured import mask_words

V = 1000  # not a multiple of 32: the last word is partly padding
B = 4
W = mask_words(V)
_jit_sample = jax.jit(sample, static_argnames="num_top_logprobs")


def packed(allowed: list[int]) -> np.ndarray:
    bits = np.zeros(W * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def run(rows: list[RowSampling | None], logits: np.ndarray) -> np.ndarray:
    t = SamplingTensors.build(rows, B, spare_row=B, mask_words=W)
    out, _ = _jit_sample(logits, t, PenaltyCounts.zeros(B, V), num_top_logprobs=0)
    return np.asarray(out.tokens)


def test_packed_layout_matches_llguidance():
    from llguidance.numpy import apply_token_bitmask_inplace

    logits = np.zeros((1, V), np.float32)
    apply_token_bitmask_inplace(logits, packed([0, 31, 32, 999])[None])
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [0, 31, 32, 999]


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_only_allowed_tokens_are_sampled(temperature):
    rng = np.random.default_rng(0)
    allowed = [3, 64, 511, 998]
    logits = rng.normal(size=(B, V)).astype(np.float32) * 4
    logits[:, 7] = 100.0  # the unconstrained favourite, forbidden in the masked rows
    seen = set()
    for seed in range(20):
        rows = [
            RowSampling(
                SamplingParams(temperature=temperature, seed=seed), seed=seed, position=5, token_mask=packed(allowed)
            )
            for _ in range(2)
        ]
        rows += [RowSampling(SamplingParams(temperature=temperature), seed=seed, position=5), None]
        tokens = run(rows, logits)
        assert tokens[0] in allowed and tokens[1] in allowed
        assert tokens[2] == 7  # an unconstrained row of the same batch still gets its favourite
        seen.update(tokens[:2].tolist())
        if temperature == 0.0:
            assert tokens[:2].tolist() == [max(allowed, key=lambda i: logits[r, i]) for r in (0, 1)]
    if temperature > 0.0:
        assert len(seen) > 1  # seeded draws spread over the allowed set


def test_greedy_picks_the_best_allowed_token_per_row():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(B, V)).astype(np.float32)
    sets = [[1, 2, 3], [500, 900], [999], list(range(0, V, 7))]
    rows = [RowSampling(SamplingParams(temperature=0.0), 0, 0, token_mask=packed(s)) for s in sets]
    tokens = run(rows, logits)
    assert tokens.tolist() == [max(s, key=lambda i: logits[r, i]) for r, s in enumerate(sets)]


def test_seeded_masked_draw_is_reproducible_and_batch_invariant():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(B, V)).astype(np.float32)
    allowed = list(range(100, 200))
    row = RowSampling(SamplingParams(temperature=1.0, seed=42), seed=42, position=9, token_mask=packed(allowed))
    alone = run([row, None, None, None], np.repeat(logits[:1], B, 0))[0]
    other = RowSampling(SamplingParams(temperature=0.7), seed=3, position=1)
    among = run([other, other, row, None], np.repeat(logits[:1], B, 0))[2]
    assert alone == among and alone in allowed


def test_mask_of_the_wrong_width_is_refused():
    row = RowSampling(SamplingParams(), 0, 0, token_mask=np.zeros(W - 1, np.int32))
    with pytest.raises(ValueError, match="token mask"):
        SamplingTensors.build([row], B, spare_row=B, mask_words=W)
