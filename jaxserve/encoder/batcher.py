"""The encoder's scheduler (no JAX here): which waiting inputs run in the next step, and the
(rows, tokens) bucket they are padded to.

An encoder attends over a whole input at once, so an input is never chunked: a step takes waiting
inputs in arrival order while the padded batch (rows bucket x the token bucket of its longest
input) stays within the step's token budget and the row limit. The first waiting input always
fits (every bucket up to `max_len` tokens has at least one row).
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.pooling import PromptPooling


@dataclasses.dataclass
class EncoderRequest:
    request_id: str
    token_ids: list[int]
    pooling: PromptPooling

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def pooled_rows(self) -> int:
        """How many of its rows its pooler takes (all its rows run in one step)."""
        n = len(self.token_ids)
        return len(self.pooling.pooler.rows(0, n, n))


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2 low, 4 low, ... and then `high` itself: the buckets that cover [1, high]."""
    out, n = [], low
    while n < high:
        out.append(n)
        n *= 2
    return (*out, high)


@dataclasses.dataclass(frozen=True)
class EncoderBuckets:
    """The shapes the encoder is compiled for: token counts up to `max_len`, rows up to
    `max_rows`, and only pairs whose rows x tokens fits `token_budget`."""

    max_len: int
    max_rows: int
    token_budget: int

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return powers_of_two(min(16, self.max_len), self.max_len)

    def rows_for(self, tokens: int) -> tuple[int, ...]:
        """The row buckets compiled for a token bucket (at least 1)."""
        return powers_of_two(1, max(1, min(self.max_rows, self.token_budget // tokens)))

    def all(self) -> list[tuple[int, int]]:
        return [(rows, tokens) for tokens in self.token_buckets for rows in self.rows_for(tokens)]

    def tokens_bucket(self, length: int) -> int:
        return next(t for t in self.token_buckets if t >= length)

    def rows_bucket(self, rows: int, tokens: int) -> int | None:
        return next((r for r in self.rows_for(tokens) if r >= rows), None)


class EncoderBatcher:
    def __init__(self, buckets: EncoderBuckets) -> None:
        self.buckets = buckets
        self.waiting: collections.deque[EncoderRequest] = collections.deque()

    def add(self, request: EncoderRequest) -> None:
        if not 0 < len(request.token_ids) <= self.buckets.max_len:
            raise ValueError(f"an input has {len(request.token_ids)} tokens; 1 to {self.buckets.max_len} are served")
        self.waiting.append(request)

    def remove(self, request_id: str) -> list[EncoderRequest]:
        removed = [r for r in self.waiting if r.request_id == request_id]
        self.waiting = collections.deque(r for r in self.waiting if r.request_id != request_id)
        return removed

    def next_batch(self) -> tuple[list[EncoderRequest], tuple[int, int]]:
        """The inputs of the next step, in arrival order, and their (rows, tokens) bucket."""
        batch: list[EncoderRequest] = []
        shape = (0, 0)
        longest = 0
        for request in self.waiting:
            tokens = self.buckets.tokens_bucket(max(longest, len(request.token_ids)))
            rows = self.buckets.rows_bucket(len(batch) + 1, tokens)
            if rows is None:
                break
            batch.append(request)
            longest, shape = max(longest, len(request.token_ids)), (rows, tokens)
        for _ in batch:
            self.waiting.popleft()
        return batch, shape
