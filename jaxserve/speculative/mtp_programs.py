"""The MTP layer's device program: catch up, then draft a chain of k tokens, in one dispatch (compiled by
`DraftPrograms` with `mtp_chain` as its chain).

A call takes S sequences' new rows as one ragged prefill (`MtpInputs`): row p of a sequence is position p,
with the target's hidden state h_p and the token t_{p+1} (`jaxserve.speculative.mtp_model`). It writes their
latents into the MTP layer's own cache and reads the logits after each sequence's last row, p = N - 2 for a
request of N tokens: the distribution of t_N, the first draft. Then k - 1 decode steps in a `lax.scan` feed
each drafted token back at the next position, with the layer's own output at the position before as its
hidden state (the target's is not known there; `mtp_forward`'s `chained`). Tokens are drawn as the draft model's are
(`draft_programs._next_token`: argmax for greedy rows, else from q = softmax(logits / temperature), keyed by
the request's seed and the drafted token's position), and q is returned per drafted token for rejection
sampling.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.model import AttentionMetadata
from jaxserve.model.layer_stack import LayerStack
from jaxserve.speculative.draft_programs import DRAFT_STREAM, DraftInputs, _next_token
from jaxserve.speculative.mtp_model import mtp_forward


class MtpInputs(NamedTuple):
    """The rows of a `DraftInputs` (their tokens: t_{p+1} of each row's position p; `seq_lens`: each sequence's
    MTP length after them, N - 1) and the target's hidden state of each row."""

    draft: DraftInputs
    hidden: np.ndarray  # f32[T, E]

    @classmethod
    def zeros(cls, seqs: int, tokens: int, width: int, hidden_size: int) -> MtpInputs:
        return cls(DraftInputs.zeros(seqs, tokens, width), np.zeros((tokens, hidden_size), np.float32))

    @classmethod
    def example(cls, hidden_size: int) -> functools.partial:
        """`zeros` of a variant's (S, T, W), as `DraftPrograms` takes it."""
        return functools.partial(cls.zeros, hidden_size=hidden_size)


def mtp_chain(
    stack: LayerStack, block_size: int, k: int, params: Any, cache: Any, inputs: MtpInputs
) -> tuple[Any, jax.Array, jax.Array]:
    """(cache, drafts i32[S, k], q f32[S, k, V]): see the module docstring. `params`: `mtp_params` of the
    target's."""
    x = inputs.draft
    meta = AttentionMetadata(x.kv_slots, x.tables, x.seq_lens, x.query_start)
    hidden = inputs.hidden.astype(stack.dtype)
    logits, h, cache = mtp_forward(stack, params, x.tokens, hidden, x.positions, cache, meta, x.last_rows)
    seeds = jax.random.wrap_key_data(x.seeds, impl="threefry2x32")
    live = x.seq_lens > 0
    rows = jnp.arange(x.seq_lens.shape[0], dtype=jnp.int32)
    width = x.tables.shape[1]

    def keys(pos: jax.Array) -> jax.Array:
        return jax.vmap(lambda key, p: jax.random.fold_in(jax.random.fold_in(key, p), DRAFT_STREAM))(seeds, pos)

    first, q = _next_token(logits, keys(x.seq_lens + 1), x.temperature)

    def step(carry, j):
        cache, token, h = carry
        pos = x.seq_lens + j  # the MTP position of the row fed: d_{j + 1} and the layer's output before it
        page = x.tables[rows, jnp.minimum(pos // block_size, width - 1)]
        step_meta = AttentionMetadata(
            jnp.where(live, page * block_size + pos % block_size, 0), x.tables, jnp.where(live, pos + 1, 0)
        )
        logits, h, cache = mtp_forward(stack, params, token, h, pos, cache, step_meta, rows, chained=True)
        token, q = _next_token(logits, keys(pos + 2), x.temperature)
        return (cache, token, h), (token, q)

    (cache, _, _), (tokens, qs) = lax.scan(step, (cache, first, h), jnp.arange(k - 1, dtype=jnp.int32))
    drafts = jnp.concatenate([first[:, None], jnp.swapaxes(tokens, 0, 1)], axis=1)
    probs = jnp.concatenate([q[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    return cache, drafts, probs
