"""Accuracy of a serving mode (a dtype, a weight or KV quantization) against an f32 reference,
measured on real text through the engine's prompt-logprobs path.

`score_text` runs a text's tokens through an `LLM` as prompts with `prompt_logprobs=1`: at every
position after the first it gets the log-probability of the text's actual next token and the
model's own most likely token there. `compare` puts two such scorings of the same tokens side by
side: top-1 agreement, each perplexity, their ratio, the first position where the top-1 tokens
differ. `jaxserve bench accuracy` (bench/cli.py) builds the engines from engine flags and prints
the table (`print_table`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class TextScores:
    """One model's scores of a text: entry i is about token i + 1 of `token_ids`, predicted from
    the tokens before it (within its window)."""

    token_ids: tuple[int, ...]  # the whole scored text, including its first token
    logprobs: np.ndarray  # [n - 1] float64: log-probability of the actual next token
    top1: np.ndarray  # [n - 1] int64: the model's most likely next token

    def __post_init__(self) -> None:
        n = len(self.token_ids) - 1
        if self.logprobs.shape != (n,) or self.top1.shape != (n,):
            raise ValueError(
                f"{len(self.token_ids)} tokens need {n} scores, got {self.logprobs.shape} "
                f"log-probabilities and {self.top1.shape} top-1 tokens"
            )

    @property
    def num_positions(self) -> int:
        return len(self.logprobs)

    @property
    def perplexity(self) -> float:
        return math.exp(-float(np.mean(self.logprobs)))


@dataclasses.dataclass(frozen=True)
class Agreement:
    positions: int
    top1_agreement: float  # fraction of positions whose top-1 tokens are equal
    reference_perplexity: float
    candidate_perplexity: float
    perplexity_ratio: float  # candidate / reference
    first_divergence: int | None  # first position (index into the scores) with different top-1 tokens
    mean_abs_logprob_diff: float  # of the actual next tokens' log-probabilities


def compare(reference: TextScores, candidate: TextScores) -> Agreement:
    """How closely `candidate` follows `reference` on the same tokens."""
    if reference.token_ids != candidate.token_ids:
        raise ValueError("the two scorings are of different token sequences")
    if not reference.num_positions:
        raise ValueError("nothing was scored (a text needs at least two tokens)")
    differ = np.flatnonzero(reference.top1 != candidate.top1)
    ref_ppl, cand_ppl = reference.perplexity, candidate.perplexity
    return Agreement(
        positions=reference.num_positions,
        top1_agreement=1.0 - len(differ) / reference.num_positions,
        reference_perplexity=ref_ppl,
        candidate_perplexity=cand_ppl,
        perplexity_ratio=cand_ppl / ref_ppl,
        first_divergence=int(differ[0]) if len(differ) else None,
        mean_abs_logprob_diff=float(np.mean(np.abs(reference.logprobs - candidate.logprobs))),
    )


def windows(num_tokens: int, window: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most `window` tokens that overlap by one, so that every token
    after the first is the target of exactly one position (the context restarts at each span)."""
    if window < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {window}")
    spans, start = [], 0
    while start < num_tokens - 1:
        end = min(start + window, num_tokens)
        spans.append((start, end))
        start = end - 1
    return spans


def score_text(llm: Any, token_ids: Sequence[int], window: int | None = None) -> TextScores:
    """Score every next-token position of `token_ids` with `llm` (a jaxserve `LLM`), in windows
    of `window` tokens (default: the engine's context less the one token each request generates),
    all submitted at once so the engine batches them."""
    from jaxserve import SamplingParams

    ids = [int(t) for t in token_ids]
    window = window or llm.engine.config.max_model_len - 1
    spans = windows(len(ids), window)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": ids[a:b]} for a, b in spans], params, use_tqdm=False)
    logprobs, top1 = [], []
    for (a, b), out in zip(spans, outs):
        scores = out.prompt_logprobs[1:]  # position 0 has no context
        if len(scores) != b - a - 1 or any(s.token_id != t for s, t in zip(scores, ids[a + 1 : b])):
            raise RuntimeError(f"the engine scored window [{a}, {b}) wrongly")
        logprobs.extend(s.logprob for s in scores)
        top1.extend(s.top[0][0] for s in scores)
    return TextScores(tuple(ids), np.asarray(logprobs, np.float64), np.asarray(top1, np.int64))


def engine_footprint(llm: Any) -> dict[str, int]:
    """The engine's own accounting: bytes of its weights as held, and how many tokens of KV one
    GiB holds (the allocated cache's bytes over the tokens its blocks hold)."""
    import jax

    runner = llm.engine.runner
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.cache))
    tokens = runner.num_blocks * llm.engine.config.block_size
    return {"weight_bytes": runner.weight_bytes, "kv_tokens_per_gib": int(tokens * (1 << 30) // cache_bytes)}


def format_table(rows: list[dict[str, Any]]) -> str:
    """One line per mode: the reference first (its agreement is 1 by definition)."""
    head = (
        f"{'mode':<32} {'top-1 agree':>11} {'perplexity':>10} {'ppl ratio':>9} {'|dlogp|':>8} "
        f"{'first div':>9} {'weights MB':>10} {'KV tok/GiB':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        div = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        lines.append(
            f"{r['mode']:<32} {r['top1_agreement']:>11.4f} {r['perplexity']:>10.3f} "
            f"{r['perplexity_ratio']:>9.4f} {r['mean_abs_logprob_diff']:>8.4f} {div:>9} "
            f"{r['weight_bytes'] / 1e6:>10.1f} {r['kv_tokens_per_gib']:>10,}"
        )
    return "\n".join(lines)


def reference_row(mode: str, scores: TextScores, footprint: dict[str, int]) -> dict[str, Any]:
    return {
        "mode": mode,
        "positions": scores.num_positions,
        "top1_agreement": 1.0,
        "perplexity": scores.perplexity,
        "perplexity_ratio": 1.0,
        "mean_abs_logprob_diff": 0.0,
        "first_divergence": None,
        **footprint,
    }


def candidate_row(mode: str, agreement: Agreement, footprint: dict[str, int]) -> dict[str, Any]:
    return {
        "mode": mode,
        "positions": agreement.positions,
        "top1_agreement": agreement.top1_agreement,
        "perplexity": agreement.candidate_perplexity,
        "perplexity_ratio": agreement.perplexity_ratio,
        "mean_abs_logprob_diff": agreement.mean_abs_logprob_diff,
        "first_divergence": agreement.first_divergence,
        **footprint,
    }
