"""The device program of a head over the target's hidden states (the MTP layer; an EAGLE-3 head the same way,
its hidden rows the target's aux states): catch up, then draft a chain of k tokens, in one dispatch (compiled
by `DraftPrograms` with `mtp_chain`, or `hidden_chain` of another forward, as its chain).

A call takes S sequences' new rows as one ragged prefill (`MtpInputs`): row p of a sequence is position p,
with the target's hidden state h_p and the token t_{p+1} (`jaxserve.speculative.mtp_model`). It writes their
latents into the MTP layer's own cache and reads the logits after each sequence's last row, p = N - 2 for a
request of N tokens: the distribution of t_N, the first draft. Then up to k - 1 decode steps in a loop feed
each drafted token back at the next position, with the layer's own output at the position before as its
hidden state (the target's is not known there; `mtp_forward`'s `chained`). The chain is the draft model's
(`draft_programs.chain_drafts`: argmax for greedy rows, else a draw from q = softmax(logits / temperature),
keyed by the request's seed and the drafted token's position), and q is returned per drafted token for
rejection sampling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import AttentionMetadata
from jaxserve.speculative.draft_programs import DraftInputs, chain_drafts
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


def hidden_chain(
    forward: Callable[..., tuple[jax.Array, jax.Array, Any]],
    model: Any,
    block_size: int,
    k: int,
    params: Any,
    cache: Any,
    inputs: MtpInputs,
) -> tuple[Any, jax.Array, jax.Array]:
    """(cache, drafts i32[S, k], q f32[S, k, V]): see the module docstring. `forward(model, params, tokens,
    hidden, positions, cache, meta, rows, chained) -> (logits, state fed on, cache)`: the head's (`mtp_forward`,
    with `model` the MTP layer's `LayerStack` and `params` the target's `mtp_params`; or an EAGLE-3 head's,
    `jaxserve.speculative.eagle3_model.eagle3_forward`)."""
    x = inputs.draft
    meta = AttentionMetadata(x.kv_slots, x.tables, x.seq_lens, x.query_start)
    hidden = inputs.hidden.astype(model.dtype)
    logits, h, cache = forward(model, params, x.tokens, hidden, x.positions, cache, meta, x.last_rows)
    rows = jnp.arange(x.seq_lens.shape[0], dtype=jnp.int32)

    def feed(state: tuple[Any, jax.Array], token: jax.Array, pos: jax.Array, step_meta: AttentionMetadata):
        """The row at the head's position `pos`: the token just drafted, and the head's output at the row before."""
        cache, h = state
        logits, h, cache = forward(model, params, token, h, pos, cache, step_meta, rows, chained=True)
        return logits, (cache, h)

    # A row at position p drafts the token at p + 2: the keys are the drafted tokens' positions.
    (cache, _), drafts, probs = chain_drafts(x, block_size, k, logits, (cache, h), feed, key_offset=1)
    return cache, drafts, probs


mtp_chain = functools.partial(hidden_chain, mtp_forward)  # chain(stack, block_size, k, params, cache, inputs)
