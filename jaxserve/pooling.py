"""Pooling, the plug-in that turns a prompt's final hidden states into one embedding (no JAX here).

A `Pooler` says which prompt rows an embedding takes (their mean is the embedding); it is
chosen from the model's config: a decoder LM's by `--embedding-pooling` (last token, mean or CLS),
an encoder's by its sentence-transformers `1_Pooling/config.json` (or a GGUF's `pooling_type`).
Both kinds of model use the same path: each step that computes prompt rows returns the sum of
the rows the pooler takes (decoder: the runner's `pool` program over the flattened prefill;
encoder: `jaxserve.model.encoder.pooled_sums` over a padded batch), and a `PromptPooling` adds
them up (the server finishes the vector: `server.embedding_inputs.finish_embedding`).

A decoder's prompt may be prefilled in chunks, recomputed after preemption, or partly taken from
the prefix cache. Each prefill step that runs part of the prompt pools the rows no earlier
launched step pools (a recompute computes some rows again; they count once). Mean pooling needs
every prompt row and CLS pooling the first, so a prefix-cache hit may cover only the rows already
pooled (`Request.num_cacheable_tokens`); last-token pooling needs the last row, always computed.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


class Pooler(Protocol):
    """Which rows of a prompt an embedding pools (their mean is the embedding)."""

    name: str

    def rows(self, start: int, stop: int, num_prompt: int) -> range:
        """The prompt positions among [start, stop) that this pooling takes."""
        ...

    def must_compute(self) -> bool:
        """Whether the rows it takes must be computed by the request's own steps rather than found
        in a prefix cache (the last row always is computed, whatever the cache holds)."""
        ...


@dataclasses.dataclass(frozen=True)
class MeanPooler:
    name: str = "mean"

    def rows(self, start: int, stop: int, num_prompt: int) -> range:
        return range(start, min(stop, num_prompt))

    def must_compute(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class LastTokenPooler:
    name: str = "last"

    def rows(self, start: int, stop: int, num_prompt: int) -> range:
        return range(max(start, num_prompt - 1), min(stop, num_prompt))

    def must_compute(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class ClsPooler:
    """The first token's row (BERT's [CLS])."""

    name: str = "cls"

    def rows(self, start: int, stop: int, num_prompt: int) -> range:
        return range(start, min(stop, num_prompt, 1))

    def must_compute(self) -> bool:
        return True


POOLERS: dict[str, Pooler] = {p.name: p for p in (MeanPooler(), LastTokenPooler(), ClsPooler())}


def pooler_for(kind: str) -> Pooler:
    if kind not in POOLERS:
        raise ValueError(f"unknown pooling {kind!r}; known: {sorted(POOLERS)}")
    return POOLERS[kind]


@dataclasses.dataclass
class PromptPooling:
    """What one embedding request gathers while its prompt is computed: the sum and count of
    the rows its pooler took."""

    kind: str  # a `POOLERS` name
    launched: int = 0  # prompt positions below this are pooled by launched steps
    total: np.ndarray | None = None  # sum of the pooled rows read so far (float64)
    rows: int = 0

    def __post_init__(self) -> None:
        self.pooler = pooler_for(self.kind)

    def positions(self, start: int, count: int, num_prompt: int) -> range:
        """The prompt positions that a step computing [start, start + count) pools."""
        return self.pooler.rows(max(start, self.launched), start + count, num_prompt)

    def first_needed(self, num_prompt: int) -> int | None:
        """The first prompt position whose row a step must compute, not take from the prefix
        cache: the first row the pooler takes that is not pooled yet; None when the cache may
        cover any."""
        rows = self.positions(0, num_prompt, num_prompt)
        return rows.start if self.pooler.must_compute() and rows else None

    def on_launched(self, positions: range) -> None:
        self.launched = max(self.launched, positions.stop)

    def add(self, total: np.ndarray, rows: int) -> None:
        """The sum of `rows` pooled rows, read from a step."""
        total = total.astype(np.float64)
        self.total = total if self.total is None else self.total + total
        self.rows += rows

    def vector(self) -> np.ndarray:
        """The pooled vector (float32): the mean of the pooled rows, not normalised."""
        if self.total is None or self.rows == 0:
            raise ValueError("no prompt row was pooled")
        return (self.total / self.rows).astype(np.float32)
