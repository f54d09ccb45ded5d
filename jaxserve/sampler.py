"""On-device sampling for a padded batch of logits, jittable inside the runner's step.

Per row: logit bias (and the ban on stop tokens before `min_tokens`), the token mask of
structured output (a packed bitmask computed on the host; batches without one skip it), then
penalties (vLLM/HF semantics: repetition over prompt + output
tokens, then frequency and presence over output tokens), then either greedy argmax (temperature 0) or
temperature, top-k, top-p (over the top-k survivors, renormalised), min-p and a random
draw. The draw's key comes from the request's seed and the position being generated only
(`fold_in(key(seed), position)`), never from the row index or the batch, so a seeded
request yields the same tokens alone or among any neighbours.

Nothing here sorts the vocabulary (a full sort costs ~10 ms per row on CPU):
- top-k: `lax.top_k` with a small static k when every row asks for k <= 64, otherwise an
  exact bisection over the logits' bit patterns for the k-th largest value. Both give the
  same threshold, so which one runs (decided by the whole batch) never changes a row.
- top-p: the same kind of bisection, over the (unnormalised) probabilities, for the
  smallest set of most likely tokens whose mass reaches p; tokens tied in probability
  with the last one are kept too, as with top-k ties.
- the draw is a two-level Gumbel-max: a block of 256 tokens is chosen with probability
  equal to its mass, then a token inside it, so a row needs ~450 random numbers, not V.
Each expensive stage sits behind a `lax.cond` on "does any row need it": all-greedy
batches make no random draws, and padding rows (greedy, no penalties) enable nothing.

Its inputs, the rows' settings (`SamplingTensors`) and the penalties' token counts on the device
(`PenaltyCounts`), are built in `sampling_tensors.py`; `sample` adds each sampled token to the
counts, so no step ships a history.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sampling_tensors import PenaltyCounts, SamplingTensors

TOP_K_FAST_MAX = 64  # rows with top_k <= this use lax.top_k instead of the bisection
BLOCK = 256  # tokens per block of the two-level argmax and Gumbel-max draw
_KEY_BITS = 32  # the most bisection steps: one per bit of a float32 key


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]: raw log-softmax of the sampled token; NaN if no row asked
    top_ids: jax.Array  # i32[B, K]: most likely tokens (raw logits); -1 if no row asked
    top_logprobs: jax.Array  # f32[B, K]: their raw log-softmax; -inf if no row asked


def sample(
    logits: jax.Array, t: SamplingTensors, counts: PenaltyCounts, num_top_logprobs: int = MAX_LOGPROBS
) -> tuple[SamplerOutput, PenaltyCounts]:
    """Chooses one token per row of `logits` f32[B, V] and counts it in its PenaltyCounts row.
    `num_top_logprobs` is static."""
    raw = logits.astype(jnp.float32)
    biased = lax.cond(jnp.any(t.bias_ids >= 0), apply_logit_bias, lambda x, *_: x, raw, t)
    if t.token_mask.shape[1]:  # a batch built without mask words has no masks
        biased = lax.cond(jnp.any(t.token_mask != -1), apply_token_mask, lambda x, *_: x, biased, t)
    penalized = lax.cond(_any_penalty(t), apply_penalties, lambda x, *_: x, biased, t, counts)
    greedy_tokens = _argmax(penalized)
    is_greedy = t.temperature <= 0.0
    tokens = lax.cond(
        jnp.all(is_greedy),
        lambda: greedy_tokens,
        lambda: jnp.where(is_greedy, greedy_tokens, _draw(sampling_logits(penalized, t), t)),
    )
    logprobs, top_ids, top_logprobs = _logprobs(raw, tokens, t.num_logprobs, num_top_logprobs)
    counts = lax.cond(_any_penalty(t), _count_tokens, lambda c, *_: c, counts, t, tokens)
    return SamplerOutput(tokens, logprobs, top_ids, top_logprobs), counts


def _count_tokens(counts: PenaltyCounts, t: SamplingTensors, tokens: jax.Array) -> PenaltyCounts:
    """Add each penalised row's sampled token to its PenaltyCounts row (the spare row is left at zero)."""
    counted = (t.penalty_rows != counts.spare_row).astype(jnp.int32)
    return dataclasses.replace(counts, output=counts.output.at[t.penalty_rows, tokens].add(counted))


def apply_logit_bias(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Adds each row's biases to its tokens' logits (empty entries, id -1, are dropped)."""
    vocab = logits.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, t.bias_ids.shape, 0)
    ids = jnp.where(t.bias_ids < 0, vocab, t.bias_ids)
    return logits.at[rows, ids].add(t.bias_values, mode="drop")


def apply_token_mask(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """-inf for the tokens each row's packed mask forbids (a row of -1 words allows all)."""
    batch, vocab = logits.shape
    words = lax.bitcast_convert_type(t.token_mask, jnp.uint32)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    allowed = bits.reshape(batch, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, t: SamplingTensors, counts: PenaltyCounts) -> jax.Array:
    """Repetition penalty over prompt + output tokens, then frequency and presence over output."""
    return penalize(logits, t, counts.output[t.penalty_rows], counts.prompt[t.penalty_rows])


def penalize(logits: jax.Array, t: SamplingTensors, output_counts: jax.Array, in_prompt: jax.Array) -> jax.Array:
    """`apply_penalties` with each row's output token counts [B, V] and prompt tokens [B, V]
    given (speculative verification adds the draft tokens before a row to its counts)."""
    output_counts = output_counts.astype(jnp.float32)
    seen = in_prompt | (output_counts > 0)
    rep = t.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - t.frequency_penalty[:, None] * output_counts
    return x - t.presence_penalty[:, None] * (output_counts > 0)


def sampling_logits(penalized: jax.Array, t: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits with -inf outside the top-k, top-p and min-p sets.

    Rows with temperature 0 are scaled by 1 (they are answered by argmax instead).
    """
    batch, vocab = penalized.shape
    temperature = jnp.where(t.temperature > 0.0, t.temperature, 1.0)
    x = penalized / temperature[:, None]
    row_max = jnp.max(x, axis=-1)
    neg_inf = jnp.full((batch,), -jnp.inf, jnp.float32)

    top_k_on = (t.top_k > 0) & (t.top_k < vocab)
    k = jnp.where(top_k_on, t.top_k, vocab)
    k_threshold = lax.cond(jnp.any(top_k_on), _top_k_threshold, lambda *_: neg_inf, x, k)
    k_threshold = jnp.where(top_k_on, k_threshold, -jnp.inf)

    top_p_on = t.top_p < 1.0
    p_threshold = lax.cond(
        jnp.any(top_p_on),
        _top_p_threshold,
        lambda *_: neg_inf,
        x,
        row_max,
        k_threshold,
        t.top_p,
    )
    p_threshold = jnp.where(top_p_on, p_threshold, -jnp.inf)

    # min-p compares probabilities with the largest one; the ratio is unchanged by top-k/p.
    min_p_threshold = jnp.where(t.min_p > 0.0, row_max + jnp.log(t.min_p), -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(k_threshold, p_threshold), min_p_threshold)
    return jnp.where(x >= threshold[:, None], x, -jnp.inf)


def _any_penalty(t: SamplingTensors) -> jax.Array:
    return jnp.any((t.presence_penalty != 0.0) | (t.frequency_penalty != 0.0) | (t.repetition_penalty != 1.0))


def _argmax(x: jax.Array) -> jax.Array:
    """First index of each row's maximum, found block by block.

    On CPU both `jnp.argmax` and a one-level "first index equal to the max" hit a slow path
    of XLA (~40 and ~80 ms for [64, 49152]); one max pass plus work on [B, V / 256] and
    [B, 256] costs ~1 ms.
    """
    blocks = _blocks(x)
    block_max = jnp.max(blocks, axis=-1)
    row_max = jnp.max(block_max, axis=-1, keepdims=True)
    block = _first_true(block_max == row_max)
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0, :]
    return jnp.minimum(block * BLOCK + _first_true(inside == row_max), x.shape[-1] - 1)


def _first_true(mask: jax.Array) -> jax.Array:
    """Index of the first True of each row of a small [B, n] mask (n if none: a NaN row)."""
    n = mask.shape[-1]
    return jnp.min(jnp.where(mask, lax.broadcasted_iota(jnp.int32, mask.shape, 1), n), axis=-1)


def _blocks(x: jax.Array) -> jax.Array:
    """[B, V] -> [B, ceil(V / BLOCK), BLOCK], padded with -inf."""
    batch, vocab = x.shape
    num_blocks = -(-vocab // BLOCK)
    padded = jnp.pad(x, ((0, 0), (0, num_blocks * BLOCK - vocab)), constant_values=-jnp.inf)
    return padded.reshape(batch, num_blocks, BLOCK)


def _top_k_threshold(x: jax.Array, k: jax.Array) -> jax.Array:
    """The k-th largest value of each row (k = V for rows without top-k)."""
    fast_k = min(TOP_K_FAST_MAX, x.shape[-1])

    def by_top_k(x: jax.Array, k: jax.Array) -> jax.Array:
        values = lax.top_k(x, fast_k)[0]
        return jnp.take_along_axis(values, jnp.clip(k - 1, 0, fast_k - 1)[:, None], 1)[:, 0]

    def by_bisection(x: jax.Array, k: jax.Array) -> jax.Array:
        keys = _order_key(x)
        hi = jnp.max(keys, axis=-1)
        # All V >= k tokens are kept at the minimum; rows without top-k (k = V) start converged.
        lo = jnp.where(k < x.shape[-1], jnp.min(keys, axis=-1), hi)
        return _from_order_key(_largest_key(keys, None, k.astype(jnp.float32), lo, hi))

    return lax.cond(jnp.all(k <= fast_k), by_top_k, by_bisection, x, k)


def _top_p_threshold(x: jax.Array, row_max: jax.Array, k_threshold: jax.Array, top_p: jax.Array) -> jax.Array:
    """Smallest-set threshold: the smallest x whose probability (within top-k) is among the
    largest ones that together reach top_p.

    Searches over the unnormalised probabilities w = exp(x - max) themselves: for w >= 0 the
    float bits are ordered like the values, and each step then reads one array.
    """
    weight = jnp.where(x >= k_threshold[:, None], jnp.exp(x - row_max[:, None]), 0.0)
    target = top_p * jnp.sum(weight, axis=-1)
    # Tokens with w < (1 - p) / V hold less than (1 - p) of the mass together, so the answer
    # lies above that (a factor e lower for rounding). The largest w is exactly 1. Rows
    # without top-p start (and stay) at 1: they cost no search steps.
    lower = jnp.where(top_p < 1.0, (1.0 - top_p) / (x.shape[-1] * np.e), 1.0)
    bits = lax.bitcast_convert_type(jnp.stack([lower, jnp.ones_like(lower)]), jnp.uint32)
    keys = lax.bitcast_convert_type(weight, jnp.uint32)
    w_key = _largest_key(keys, weight, target, bits[0], bits[1])
    w_threshold = lax.bitcast_convert_type(w_key, jnp.float32)
    return jnp.min(jnp.where(weight >= w_threshold[:, None], x, jnp.inf), axis=-1)


def _largest_key(
    keys: jax.Array, weight: jax.Array | None, target: jax.Array, lo: jax.Array, hi: jax.Array
) -> jax.Array:
    """Per row, the largest key u in [lo, hi] with sum(weight[keys >= u]) >= target.

    `weight` None counts tokens. `lo` must satisfy the condition. Bisection over uint32
    keys: exact in at most 32 steps (fewer for a narrow range), one masked sum per step.
    """

    def step(state: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        lo, hi, steps = state
        span = hi - lo
        mid = lo + (span >> 1) + (span & 1)  # upper middle, never above hi
        kept = keys >= mid[:, None]
        mass = jnp.sum(kept if weight is None else jnp.where(kept, weight, 0.0), axis=-1)
        ok = mass >= target
        return (
            jnp.where(ok, mid, lo),
            jnp.where(ok, hi, jnp.where(mid > lo, mid - 1, lo)),
            steps + 1,
        )

    def searching(state: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        lo, hi, steps = state
        return jnp.any(lo < hi) & (steps < _KEY_BITS)

    lo, _, _ = lax.while_loop(searching, step, (jnp.minimum(lo, hi), hi, 0))
    return lo


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys ordered like the float32 values (negatives flipped, positives signed)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_key(keys: jax.Array) -> jax.Array:
    positive = (keys >> 31) == 1
    bits = jnp.where(positive, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return lax.bitcast_convert_type(bits, jnp.float32)


def row_keys(t: SamplingTensors) -> jax.Array:
    """Each row's random key: fold_in(key(seed), position), nothing else."""
    seeds = jax.random.wrap_key_data(t.seed, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(seeds, t.positions)


def _gumbel_noise(t: SamplingTensors, size: int) -> jax.Array:
    """f32[B, size] Gumbel noise per row, keyed by fold_in(key(seed), position) only."""
    return jax.vmap(lambda key: jax.random.gumbel(key, (size,)))(row_keys(t))


def _draw(masked: jax.Array, t: SamplingTensors) -> jax.Array:
    """One draw per row from softmax(masked), by a two-level Gumbel-max.

    A block is chosen with Gumbel noise on the blocks' log-sum-exp (probability = its mass),
    then a token inside it with Gumbel noise on its logits: exact, and ~V/256 + 256 random
    numbers per row instead of V.
    """
    blocks = _blocks(masked)
    num_blocks = blocks.shape[1]
    noise = _gumbel_noise(t, num_blocks + BLOCK)
    block = _argmax(jax.nn.logsumexp(blocks, axis=-1) + noise[:, :num_blocks])
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0, :]
    return block * BLOCK + _argmax(inside + noise[:, num_blocks:])


def _logprobs(
    raw: jax.Array, tokens: jax.Array, num_logprobs: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw log-softmax of the sampled tokens and the top k, computed only if a row asks."""
    batch = raw.shape[0]
    log_z = lax.cond(
        jnp.any(num_logprobs >= 0),
        lambda: jax.nn.logsumexp(raw, axis=-1),
        lambda: jnp.full((batch,), jnp.nan, jnp.float32),
    )
    sampled = jnp.take_along_axis(raw, tokens[:, None], axis=1)[:, 0] - log_z
    if k == 0:
        return sampled, jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0), jnp.float32)

    def top() -> tuple[jax.Array, jax.Array]:
        values, ids = lax.top_k(raw, min(k, raw.shape[1]))  # a vocabulary smaller than k: pad
        pad = ((0, 0), (0, k - values.shape[1]))
        ids = jnp.pad(ids.astype(jnp.int32), pad, constant_values=-1)
        return ids, jnp.pad(values - log_z[:, None], pad, constant_values=-jnp.inf)

    def none() -> tuple[jax.Array, jax.Array]:
        return jnp.full((batch, k), -1, jnp.int32), jnp.full((batch, k), -jnp.inf, jnp.float32)

    top_ids, top_logprobs = lax.cond(jnp.any(num_logprobs > 0), top, none)
    return sampled, top_ids, top_logprobs
