"""The sampler's inputs: each row's sampling settings (`SamplingTensors`, built on the host from
a request's `SamplingParams`, one int32 array of settings shipped per step), and the penalties'
per-request token counts that live on the device (`PenaltyCounts`, one row per batch row: a
row is set from the request's history once, when it gets its batch row, by `set_penalty_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams

MAX_EOS_IDS = 8
# Bias entries per row: the request's logit_bias, then the stop tokens banned before min_tokens.
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + MAX_EOS_IDS


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """What the builder needs to know about one running request for this step."""

    params: SamplingParams
    seed: int  # the request's seed, or the one drawn for it at creation
    position: int  # index (in the whole sequence) of the token being generated
    banned_ids: Sequence[int] = ()  # tokens that cannot be sampled now (stop tokens before min_tokens)
    penalty_row: int = -1  # its row of PenaltyCounts (requests with penalties only)
    token_mask: np.ndarray | None = None  # int32[ceil(V / 32)] allowed tokens (structured output)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyCounts:
    """Device state of the penalties: per batch row, how often each token was generated, and which
    tokens the prompt holds. The last row is the spare row of rows without penalties (zeros)."""

    output: jax.Array  # i32[S + 1, V]
    prompt: jax.Array  # bool[S + 1, V]

    @classmethod
    def zeros(cls, num_batch_rows: int, vocab_size: int) -> PenaltyCounts:
        return cls(
            jnp.zeros((num_batch_rows + 1, vocab_size), jnp.int32),
            jnp.zeros((num_batch_rows + 1, vocab_size), jnp.bool_),
        )

    @property
    def spare_row(self) -> int:
        return self.output.shape[0] - 1


def penalty_history(
    prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams, history_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """One request's history for `set_penalty_rows`: token ids (-1 = empty) and whether each is
    generated. Prompt tokens only matter to the repetition penalty."""
    prompt = prompt_ids if params.repetition_penalty != 1.0 else ()
    n_prompt, n_output = len(prompt), len(output_ids)
    if n_prompt + n_output > history_len:
        raise ValueError(f"{n_prompt + n_output} history tokens exceed the history length {history_len}")
    history = np.full(history_len, -1, np.int32)
    is_output = np.zeros(history_len, np.bool_)
    history[:n_prompt] = prompt
    history[n_prompt : n_prompt + n_output] = output_ids
    is_output[n_prompt : n_prompt + n_output] = True
    return history, is_output


def set_penalty_rows(
    counts: PenaltyCounts, batch_rows: jax.Array, history: jax.Array, is_output: jax.Array
) -> PenaltyCounts:
    """Set rows `batch_rows` [R] (-1 = none) from histories [R, L] (token ids, -1 = empty) whose
    `is_output` [R, L] marks the generated tokens."""
    vocab = counts.output.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, history.shape, 0)
    ids = jnp.where(history < 0, vocab, history)  # out of range: dropped by the scatter
    output = jnp.zeros((history.shape[0], vocab), jnp.int32).at[rows, ids].add(is_output.astype(jnp.int32), mode="drop")
    prompt_ids = jnp.where(is_output, vocab, ids)
    prompt = jnp.zeros((history.shape[0], vocab), jnp.bool_).at[rows, prompt_ids].set(True, mode="drop")
    target = jnp.where(batch_rows < 0, counts.output.shape[0], batch_rows)  # dropped too
    return PenaltyCounts(
        counts.output.at[target].set(output, mode="drop"), counts.prompt.at[target].set(prompt, mode="drop")
    )


class _Setting:
    """A per-row setting of SamplingTensors: `words` columns of its `settings` array (the next ones,
    in the order the settings are defined), bit-cast to `dtype`: [B] for one word, [B, words]
    for more. On the host it is a numpy view, so writing it writes `settings`."""

    def __init__(self, dtype: type, words: int = 1):
        self.dtype, self.words = np.dtype(dtype), words

    def __set_name__(self, owner: type, name: str) -> None:
        self.start = owner.SETTING_WORDS
        owner.SETTING_WORDS += self.words

    def __get__(self, t: SamplingTensors | None, owner: type) -> jax.Array | _Setting:
        if t is None:
            return self
        words = t.settings[:, self.start : self.start + self.words]
        if isinstance(words, np.ndarray):
            values = words.view(self.dtype)
        else:
            values = lax.bitcast_convert_type(words, self.dtype)
        return values[:, 0] if self.words == 1 else values


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of a padded batch of B rows (numpy on the host, jax inside jit).

    The per-row scalars are the columns of one int32 array, `settings` (floats and the uint32
    seeds bit-cast), read and written through the named settings below: the persistent batch
    gathers a step's rows with one index, and the step ships them in one host-to-device transfer
    (each array argument of a compiled call is a transfer of its own). The [B, n] tables are
    arrays of their own, as a step often takes them as device constants (no row uses them).

    Padding rows are greedy with no penalties, so they never enable an expensive stage.
    """

    SETTING_WORDS: ClassVar[int] = 0  # columns of `settings` (counted as the settings are defined)

    settings: jax.Array  # i32[B, SETTING_WORDS]
    bias_ids: jax.Array  # i32[B, BIAS_WIDTH]: tokens with a logit bias, -1 = empty
    bias_values: jax.Array  # f32[B, BIAS_WIDTH]: their biases (-inf bans a token)
    token_mask: jax.Array  # i32[B, W]: bit t % 32 of word t // 32 = token t allowed; -1 = all

    temperature = _Setting(np.float32)  # f32[B]; 0 = greedy
    top_k = _Setting(np.int32)  # i32[B]; 0 = off
    top_p = _Setting(np.float32)  # f32[B]; 1 = off
    min_p = _Setting(np.float32)  # f32[B]; 0 = off
    presence_penalty = _Setting(np.float32)  # f32[B]
    frequency_penalty = _Setting(np.float32)  # f32[B]
    repetition_penalty = _Setting(np.float32)  # f32[B]
    seed = _Setting(np.uint32, 2)  # u32[B, 2]: threefry key data (high, low 32 bits of the 64-bit seed)
    positions = _Setting(np.int32)  # i32[B]: position of the token being generated
    num_logprobs = _Setting(np.int32)  # i32[B]: -1 = none, 0 = sampled token only, k = also top k
    penalty_rows = _Setting(np.int32)  # i32[B]: each row's PenaltyCounts row (the spare one: no penalties)

    @classmethod
    def build(
        cls,
        rows: Sequence[RowSampling | None],
        batch_size: int,
        spare_row: int,
        mask_words: int = 0,
    ) -> SamplingTensors:
        """Pads `rows` (None = padding row) to `batch_size` rows of numpy arrays. Rows without
        penalties read PenaltyCounts row `spare_row`; the token mask has `mask_words` =
        ceil(V / 32) words per row. (The engine builds each request's rows once, in its batch row of
        the persistent batch, `jaxserve/runner/input_batch.py`.)"""
        if len(rows) > batch_size:
            raise ValueError(f"{len(rows)} rows do not fit a batch of {batch_size}")
        live = [i for i, row in enumerate(rows) if row is not None]
        t = cls(
            settings=np.zeros((batch_size, cls.SETTING_WORDS), np.int32),
            bias_ids=np.full((batch_size, BIAS_WIDTH), -1, np.int32),
            bias_values=np.zeros((batch_size, BIAS_WIDTH), np.float32),
            token_mask=np.full((batch_size, mask_words), -1, np.int32),
        )
        masked = [i for i in live if rows[i].token_mask is not None]
        for i in masked:
            if rows[i].token_mask.shape != (mask_words,):
                raise ValueError(f"a token mask of shape {rows[i].token_mask.shape} in a batch of {mask_words} words")
            t.token_mask[i] = rows[i].token_mask
        # Padding: greedy (temperature, top_k, min_p and the seed 0), no penalties, no logprobs.
        t.top_p[:] = 1.0
        t.repetition_penalty[:] = 1.0
        t.num_logprobs[:] = -1
        t.penalty_rows[:] = spare_row
        if live:
            # One float64 table for the per-row scalars (all exact in float64), then columns.
            table = np.array([_row_scalars(rows[i]) for i in live], np.float64)
            columns = (
                t.temperature,
                t.top_p,
                t.min_p,
                t.presence_penalty,
                t.frequency_penalty,
                t.repetition_penalty,
                t.top_k,
                t.positions,
                t.num_logprobs,
            )
            for column, values in zip(columns, table.T):
                column[live] = values
            seeds = [rows[i].seed % (1 << 64) for i in live]
            t.seed[live] = np.array([(s >> 32, s & 0xFFFFFFFF) for s in seeds], np.uint32)
            for i in live:
                params = rows[i].params
                if params.has_penalties:
                    t.penalty_rows[i] = rows[i].penalty_row
                if params.logit_bias or rows[i].banned_ids:
                    biased = {**(params.logit_bias or {}), **dict.fromkeys(rows[i].banned_ids, -np.inf)}
                    if len(biased) > BIAS_WIDTH:
                        raise ValueError(f"{len(biased)} biased tokens exceed the {BIAS_WIDTH} bias entries")
                    t.bias_ids[i, : len(biased)] = list(biased)
                    t.bias_values[i, : len(biased)] = list(biased.values())
        return t

    def at_positions(self, positions: jax.Array) -> SamplingTensors:
        """The same rows, generating the tokens at `positions` (in a jitted function)."""
        column = SamplingTensors.positions.start
        return dataclasses.replace(self, settings=self.settings.at[:, column].set(positions))


def _row_scalars(row: RowSampling) -> tuple[float, ...]:
    """The row's values in the column order of SamplingTensors.build."""
    p = row.params
    logprobs = -1 if p.logprobs is None else p.logprobs
    return (
        p.temperature,
        p.top_p,
        p.min_p,
        p.presence_penalty,
        p.frequency_penalty,
        p.repetition_penalty,
        p.top_k,
        row.position,
        logprobs,
    )
