"""Statistical checks of sampled tokens shared by the speculative-decoding tests: samples against an
exact distribution, and two samples of token sequences against each other (chi-square, 1e-4 level)."""

from __future__ import annotations

import collections
import math

import numpy as np

from jaxserve import LLM, SamplingParams


def chi2_quantile(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal quantile z (3.72: 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distributed_as(samples: np.ndarray, p: np.ndarray) -> None:
    """Token ids `samples` drawn from the distribution `p` over the vocabulary: none where p is 0,
    and a chi-square goodness of fit on the rest."""
    counts = np.bincount(samples, minlength=len(p))
    assert counts[p == 0].sum() == 0, "a token outside the distribution's support (top-k / top-p)"
    expected = p[p > 0] * len(samples)
    stat = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    assert stat < chi2_quantile(int((p > 0).sum()) - 1), stat


def seeded_first_tokens(llm: LLM, prompt, n: int, top_k: int, base_seed: int) -> collections.Counter:
    """The first three tokens of `n` seeded requests for `prompt` at temperature 1 and `top_k`, four
    at a time (the speculation threshold of the tests' engines), counted."""
    found = collections.Counter()
    for group in range(0, n, 4):
        params = [
            SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=base_seed + i, ignore_eos=True)
            for i in range(group, group + 4)
        ]
        found.update(tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * 4, params, use_tqdm=False))
    return found


def assert_same_distribution(a: collections.Counter, b: collections.Counter) -> None:
    """Two samples of equal size from one distribution: a two-sample chi-square test."""
    outcomes = set(a) | set(b)
    stat = sum((a[o] - b[o]) ** 2 / (a[o] + b[o]) for o in outcomes)
    assert stat < chi2_quantile(len(outcomes) - 1), (stat, a, b)
