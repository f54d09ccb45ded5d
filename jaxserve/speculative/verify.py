"""On-device verification of drafts (n-gram or a draft model's): which draft tokens a step accepts, and
the token after them.

A verify step computes logits at every row of S = k + 1 rows per sequence: row j holds the
distribution p_j of the token after the sequence's last token and its drafts d_1..d_j. Each row
is processed exactly as `jaxserve.sampler.sample` processes a decode row (logit bias and the ban
of stop tokens before min_tokens, the grammar mask, penalties with d_1..d_j counted as output
tokens, temperature, top-k, top-p, min-p), then:

- greedy rows accept d_{j+1} iff it is the argmax; the token after the last accepted draft is the
  argmax of its row, so greedy output is the one non-speculative decoding gives;
- sampled rows accept d_{j+1} with probability p_j(d_{j+1}) (the draft is a deterministic
  proposal, so this is the speculative-sampling rule min(1, p / q) with q = 1); at the first
  rejection the token is drawn from p_j with d_{j+1}'s mass removed and renormalised, and when
  every draft is accepted a bonus token is drawn from the row after the last draft. Each emitted
  token is then distributed exactly as p_j: P(d) = p(d), P(x != d) = (1 - p(d)) p(x) / (1 - p(d)).
- sampled rows whose draft was drawn from a distribution q (a draft model: `draft_probs`) accept it with
  probability min(1, p(d) / q(d)); at the first rejection the token is drawn from norm(max(0, p - q)), the
  speculative-sampling rule that keeps p: P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y)))
  max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x). A row
  whose q is all zeros (a greedy request's, or no draft) is a deterministic proposal, as above.

Randomness is keyed like the sampler's: a row's draw uses fold_in(key(seed), position), its
acceptance test a key folded from that one, so a request's output never depends on its batch.
The emitted tokens are counted into the penalty slots here, as `sample` counts its token.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.sampler import (
    _any_penalty,
    _argmax,
    _draw,
    _logprobs,
    apply_logit_bias,
    apply_token_mask,
    penalize,
    row_keys,
    sampling_logits,
)
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sampling_tensors import PenaltyCounts, SamplingTensors

_ACCEPT_STREAM = 0x5EC  # folded into a row's key for its acceptance test


class VerifyOutput(NamedTuple):
    tokens: jax.Array  # i32[B, S]: per sequence, its accepted drafts then one more token; -1 after
    logprobs: jax.Array  # f32[B * S]: raw log-softmax of each row's token (as SamplerOutput)
    top_ids: jax.Array  # i32[B * S, K]
    top_logprobs: jax.Array  # f32[B * S, K]


def verify(
    logits: jax.Array,
    t: SamplingTensors,
    counts: PenaltyCounts,
    drafts: jax.Array,
    history: jax.Array,
    draft_probs: jax.Array | None = None,
    num_top_logprobs: int = MAX_LOGPROBS,
) -> tuple[VerifyOutput, PenaltyCounts]:
    """logits f32[B * S, V]; `t` has a row per logits row; drafts i32[B * S]: the draft token row
    j tests (d_{j+1}), -1 for none; history i32[B * S, S - 1]: the drafts before row j (-1 empty),
    which the row's penalties count as generated; draft_probs f32[B * S, V]: q of each row's draft (None,
    or a row of zeros: a deterministic draft)."""
    rows, vocab = logits.shape
    seq_rows = history.shape[1] + 1
    raw = logits.astype(jnp.float32)
    x = lax.cond(jnp.any(t.bias_ids >= 0), apply_logit_bias, lambda x, *_: x, raw, t)
    if t.token_mask.shape[1]:
        x = lax.cond(jnp.any(t.token_mask != -1), apply_token_mask, lambda x, *_: x, x, t)

    def with_drafts_counted(x: jax.Array) -> jax.Array:
        index = lax.broadcasted_iota(jnp.int32, history.shape, 0)
        drafted = (
            jnp.zeros((rows, vocab), jnp.int32).at[index, jnp.where(history < 0, vocab, history)].add(1, mode="drop")
        )
        return penalize(x, t, counts.output[t.penalty_rows] + drafted, counts.prompt[t.penalty_rows])

    penalized = lax.cond(_any_penalty(t), with_drafts_counted, lambda x: x, x)
    greedy = _argmax(penalized)
    is_greedy = t.temperature <= 0.0
    has_draft = drafts >= 0

    def sampled() -> tuple[jax.Array, jax.Array]:
        scaled = sampling_logits(penalized, t)
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys(t), _ACCEPT_STREAM)
        u = jax.vmap(jax.random.uniform)(keys)
        if draft_probs is None:
            accept, residual = _deterministic(scaled, drafts, u, t)
        else:
            accept, residual = _drawn_from_q(scaled, drafts, draft_probs, u, t)
        return jnp.where(is_greedy, greedy == drafts, accept), jnp.where(is_greedy, greedy, residual)

    accept, other = lax.cond(jnp.all(is_greedy), lambda: (greedy == drafts, greedy), sampled)
    accept = accept & has_draft
    row_tokens = jnp.where(accept, drafts, other)
    per_seq = accept.reshape(-1, seq_rows).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod(per_seq, axis=1), axis=1)
    emitted = jnp.arange(seq_rows)[None, :] <= num_accepted[:, None]
    tokens = jnp.where(emitted, row_tokens.reshape(-1, seq_rows), -1)
    logprobs, top_ids, top_logprobs = _logprobs(raw, row_tokens, t.num_logprobs, num_top_logprobs)

    def count(counts: PenaltyCounts) -> PenaltyCounts:
        counted = ((t.penalty_rows != counts.spare_row) & emitted.reshape(-1)).astype(jnp.int32)
        return dataclasses.replace(counts, output=counts.output.at[t.penalty_rows, row_tokens].add(counted))

    counts = lax.cond(_any_penalty(t), count, lambda c: c, counts)
    return VerifyOutput(tokens, logprobs, top_ids, top_logprobs), counts


def _deterministic(scaled: jax.Array, drafts: jax.Array, u: jax.Array, t: SamplingTensors) -> tuple[jax.Array, ...]:
    """Accept d with probability p(d); the token on rejection from p without d (drafts -1 remove nothing)."""
    draft_logit = jnp.take_along_axis(scaled, jnp.maximum(drafts, 0)[:, None], axis=1)[:, 0]
    p_draft = jnp.exp(draft_logit - jax.nn.logsumexp(scaled, axis=-1))
    is_draft = lax.broadcasted_iota(jnp.int32, scaled.shape, 1) == drafts[:, None]
    return u < p_draft, _draw(jnp.where(is_draft, -jnp.inf, scaled), t)


def _drawn_from_q(
    scaled: jax.Array, drafts: jax.Array, q: jax.Array, u: jax.Array, t: SamplingTensors
) -> tuple[jax.Array, ...]:
    """Accept d with probability min(1, p(d) / q(d)); the token on rejection from norm(max(0, p - q)). A row
    whose q is all zeros is a deterministic draft (q one-hot at d; nothing when there is no draft)."""
    p = jax.nn.softmax(scaled, axis=-1)
    one_hot = lax.broadcasted_iota(jnp.int32, scaled.shape, 1) == drafts[:, None]
    q = jnp.where(jnp.sum(q, axis=-1, keepdims=True) > 0, q, one_hot.astype(jnp.float32))
    index = jnp.maximum(drafts, 0)[:, None]
    p_draft = jnp.take_along_axis(p, index, axis=1)[:, 0]
    q_draft = jnp.take_along_axis(q, index, axis=1)[:, 0]
    residual = jnp.maximum(p - q, 0.0)
    # p == q leaves no residual mass, and then no rejection either (p(d) / q(d) = 1): draw from p.
    masked = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, jnp.log(residual), scaled)
    return u * q_draft < p_draft, _draw(masked, t)
