"""On-device verification of n-gram drafts: which draft tokens a step accepts, and the token
after them.

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
    num_top_logprobs: int = MAX_LOGPROBS,
) -> tuple[VerifyOutput, PenaltyCounts]:
    """logits f32[B * S, V]; `t` has a row per logits row; drafts i32[B * S]: the draft token row
    j tests (d_{j+1}), -1 for none; history i32[B * S, S - 1]: the drafts before row j (-1 empty),
    which the row's penalties count as generated."""
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
        draft_logit = jnp.take_along_axis(scaled, jnp.maximum(drafts, 0)[:, None], axis=1)[:, 0]
        p_draft = jnp.exp(draft_logit - jax.nn.logsumexp(scaled, axis=-1))
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys(t), _ACCEPT_STREAM)
        u = jax.vmap(jax.random.uniform)(keys)
        is_draft = lax.broadcasted_iota(jnp.int32, scaled.shape, 1) == drafts[:, None]
        residual = _draw(jnp.where(is_draft, -jnp.inf, scaled), t)  # drafts -1 remove nothing
        return jnp.where(is_greedy, greedy == drafts, u < p_draft), jnp.where(is_greedy, greedy, residual)

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
