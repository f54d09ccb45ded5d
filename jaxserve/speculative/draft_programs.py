"""The draft model's device program: catch up, then draft a chain of k tokens, in one dispatch.

A call takes S sequences' new tokens as one ragged prefill (`DraftInputs`: the tokens each sequence's
target accepted since the draft last ran, ending with its last known token), writes their K/V into the
draft's own cache and reads the logits after each sequence's last token; then up to k - 1 decode steps in a
loop feed each drafted token back (`num_drafts` of the inputs: the draft length is chosen per call, on one
compiled program, `jaxserve.speculative.draft_length`). Each drafted token is the argmax of the draft's logits for a
greedy row, or a draw from q = softmax(logits / temperature) for a sampled row (keyed by the request's seed
and the token's position, in a stream of its own), and q is returned per drafted token: rejection sampling
in the target's verify step needs it (`jaxserve.speculative.verify`).

Variants are bucketed by (S, T, W): sequences, new tokens, block-table width. `compile_all` compiles them
all at warm-up and `num_compilations` counts every compilation, so serving after warm-up compiles nothing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.model import AttentionMetadata, DecoderModel

logger = logging.getLogger(__name__)

DRAFT_STREAM = 0xD4AF  # folded into a row's key for the draft's own draws


class DraftInputs(NamedTuple):
    """S sequences' new tokens as a ragged prefill of T rows (padding rows write into block 0)."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    kv_slots: np.ndarray  # i32[T]: KV slot of each row's K/V
    query_start: np.ndarray  # i32[S + 1]: row offsets of each sequence's tokens
    tables: np.ndarray  # i32[S, W]: each sequence's draft blocks
    seq_lens: np.ndarray  # i32[S]: its length after the new tokens (0: a padding sequence)
    last_rows: np.ndarray  # i32[S]: the row of its last new token (-1: padding)
    temperature: np.ndarray  # f32[S]: <= 0 drafts greedily
    seeds: np.ndarray  # u32[S, 2]: the request's key data (threefry2x32)
    num_drafts: np.ndarray  # i32[]: tokens to draft, 1 .. k (the chain stops there; a dynamic loop bound)

    @classmethod
    def zeros(cls, seqs: int, tokens: int, width: int) -> DraftInputs:
        i32 = functools.partial(np.zeros, dtype=np.int32)
        return cls(
            i32(tokens),
            i32(tokens),
            i32(tokens),
            i32(seqs + 1),
            i32((seqs, width)),
            i32(seqs),
            np.full(seqs, -1, np.int32),
            np.zeros(seqs, np.float32),
            np.zeros((seqs, 2), np.uint32),
            np.ones((), np.int32),
        )


def _next_token(logits: jax.Array, keys: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The drafted token of each row and q, the distribution it was drawn from (f32[S, V])."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    q = jax.nn.softmax(scaled, axis=-1)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32), q


def draft_chain(
    model: DecoderModel, block_size: int, k: int, params: Any, cache: Any, x: DraftInputs
) -> tuple[Any, jax.Array, jax.Array]:
    """(cache, drafts i32[S, k], q f32[S, k, V]): see the module docstring."""
    meta = AttentionMetadata(x.kv_slots, x.tables, x.seq_lens, x.query_start)
    logits, cache = model.apply({"params": params}, x.tokens, x.positions, cache, meta, x.last_rows)
    rows = jnp.where(x.seq_lens > 0, jnp.arange(x.seq_lens.shape[0], dtype=jnp.int32), -1)

    def feed(cache: Any, token: jax.Array, pos: jax.Array, step_meta: AttentionMetadata) -> tuple[jax.Array, Any]:
        return model.apply({"params": params}, token, pos, cache, step_meta, rows)

    return chain_drafts(x, block_size, k, logits, cache, feed, key_offset=0)


def chain_drafts(
    x: DraftInputs,
    block_size: int,
    k: int,
    logits: jax.Array,
    state: Any,
    feed: Callable[[Any, jax.Array, jax.Array, AttentionMetadata], tuple[jax.Array, Any]],
    key_offset: int,
) -> tuple[Any, jax.Array, jax.Array]:
    """A chain of k drafts after the catch-up's `logits` (each sequence's distribution of its first draft):
    the first drawn from them, then `x.num_drafts` - 1 steps (at most k - 1: a loop whose bound is an input,
    so every draft length runs on one compiled program; the rows past it stay 0), each feeding the token just
    drafted at the sequence's next position (N + j for the j-th, each sequence's page and slot of it in
    `x.tables`) through `feed(state, tokens, positions, metadata) -> (logits, state)`. Draft j of a sequence
    is drawn with the key of position N + j + `key_offset` (the position of the token it drafts, in the chain's
    own numbering).
    Returns (state, drafts i32[S, k], q f32[S, k, V])."""
    seeds = jax.random.wrap_key_data(x.seeds, impl="threefry2x32")
    live = x.seq_lens > 0
    rows = jnp.arange(x.seq_lens.shape[0], dtype=jnp.int32)
    width = x.tables.shape[1]

    def keys(pos: jax.Array) -> jax.Array:
        return jax.vmap(lambda key, p: jax.random.fold_in(jax.random.fold_in(key, p), DRAFT_STREAM))(seeds, pos)

    first, q = _next_token(logits.astype(jnp.float32), keys(x.seq_lens + key_offset), x.temperature)

    def step(j: jax.Array, carry: tuple[Any, jax.Array, jax.Array, jax.Array]) -> tuple[Any, ...]:
        state, token, drafts, probs = carry
        pos = x.seq_lens + j  # the position of the token fed: d_{j + 1} at N + j
        page = x.tables[rows, jnp.minimum(pos // block_size, width - 1)]
        step_meta = AttentionMetadata(
            jnp.where(live, page * block_size + pos % block_size, 0), x.tables, jnp.where(live, pos + 1, 0)
        )
        logits, state = feed(state, token, pos, step_meta)
        token, q = _next_token(logits.astype(jnp.float32), keys(pos + 1 + key_offset), x.temperature)
        drafts = lax.dynamic_update_slice(drafts, token[:, None], (0, j + 1))
        return state, token, drafts, lax.dynamic_update_slice(probs, q[:, None], (0, j + 1, 0))

    drafts = jnp.zeros((len(rows), k), jnp.int32).at[:, 0].set(first)
    probs = jnp.zeros((len(rows), k, q.shape[-1]), jnp.float32).at[:, 0].set(q)
    steps = jnp.clip(x.num_drafts, 1, k) - 1
    state, _, drafts, probs = lax.fori_loop(0, steps, step, (state, first, drafts, probs))
    return state, drafts, probs


class DraftPrograms:
    """The compiled variants of `draft_chain` for one draft model, by (S, T, W); or of another chain of the same
    signature, `chain(model, block_size, k, params, cache, inputs)`, whose inputs of a variant's shapes
    `example(S, T, W)` makes (the MTP layer's: `jaxserve.speculative.mtp_programs`)."""

    def __init__(
        self,
        model: Any,
        block_size: int,
        k: int,
        variants: list[tuple[int, int, int]],
        chain: Callable[..., tuple[Any, jax.Array, jax.Array]] = draft_chain,
        example: Callable[[int, int, int], Any] = DraftInputs.zeros,
    ) -> None:
        self.variants = sorted(variants)
        self._fn = jax.jit(functools.partial(chain, model, block_size, k), donate_argnums=(1,))
        self._example = example
        self.compiled: dict[tuple[int, int, int], Any] = {}
        self.num_compilations = 0

    def compile_all(self, params: Any, cache: Any) -> None:
        for key in self.variants:
            if key not in self.compiled:
                self._compile(key, params, cache)

    def _compile(self, key: tuple[int, int, int], params: Any, cache: Any) -> Any:
        exe = self.compiled[key] = self._fn.lower(params, cache, self._example(*key)).compile()
        self.num_compilations += 1
        return exe

    def run(self, params: Any, cache: Any, x: Any) -> tuple[Any, jax.Array, jax.Array]:
        """Run the variant of `x`'s shapes (compiled now, and counted, if warm-up did not); `x`: `DraftInputs`,
        or a chain's inputs whose `draft` field is."""
        d = getattr(x, "draft", x)
        key = (len(d.seq_lens), len(d.tokens), d.tables.shape[1])
        exe = self.compiled.get(key)
        if exe is None:
            logger.warning("compiling a new draft variant at serving time: %s", key)
            exe = self._compile(key, params, cache)
        return exe(params, cache, x)
