"""The encoder's scheduler (no JAX here): which waiting inputs run in the next step, and the
(rows, tokens) bucket they are padded to.

An encoder attends over a whole input at once, so an input is never chunked, and a step costs about
its padded rows x tokens whatever the inputs are: a 17-token input in a 32-token bucket pays for 32,
and so does every other row of its step. So token buckets are 1.5 or 1.33 times apart (16, 24, 32,
48, 64, 96, ...), and a step groups inputs of similar length: its token bucket is the oldest waiting
input's, its rows the inputs of that same token bucket (arrival order, up to the row limit and the
token budget) rounded up to a row bucket, and the rows that rounding adds, padding otherwise, carry
the longest shorter inputs (earliest first within a token bucket). So a short input is never padded
to a long one's bucket unless the row it takes would be padding anyway. The oldest waiting input is
always in the next step, so an input waits at most as many steps as there are inputs ahead of it in
arrival order. Every token bucket up to `max_len` has a one-row shape, so the oldest always fits.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools

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


def token_bucket_sizes(high: int) -> tuple[int, ...]:
    """16, 24, 32, 48, 64, 96, 128, 192, ... (powers of two and 1.5 times them) below `high`, and
    `high` itself: a bucket pads at most 50% (16 to 24), 33% above that, where powers of two
    padded up to 100%."""
    out, n = [], 16
    while n < high:
        out.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return (*out, high)


@dataclasses.dataclass(frozen=True)
class EncoderBuckets:
    """The shapes the encoder is compiled for: token counts up to `max_len`, rows up to
    `max_rows`, and only pairs whose rows x tokens fits `token_budget`."""

    max_len: int
    max_rows: int
    token_budget: int

    @functools.cached_property
    def token_buckets(self) -> tuple[int, ...]:
        return token_bucket_sizes(self.max_len)

    def rows_for(self, tokens: int) -> tuple[int, ...]:
        """The row buckets compiled for a token bucket (at least 1)."""
        return powers_of_two(1, max(1, min(self.max_rows, self.token_budget // tokens)))

    def all(self) -> list[tuple[int, int]]:
        return [(rows, tokens) for tokens in self.token_buckets for rows in self.rows_for(tokens)]

    def bucket_index(self, length: int) -> int:
        return bisect.bisect_left(self.token_buckets, length)

    def tokens_bucket(self, length: int) -> int:
        return self.token_buckets[self.bucket_index(length)]


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
        """The inputs of the next step, in arrival order, and their (rows, tokens) bucket: the oldest
        waiting input, the others of its token bucket, and shorter ones in the rows left as padding."""
        if not self.waiting:
            return [], (0, 0)
        queue = list(self.waiting)
        index = self.buckets.bucket_index(len(queue[0].token_ids))
        tokens = self.buckets.token_buckets[index]
        by_bucket: list[list[int]] = [[] for _ in range(index + 1)]
        for position, request in enumerate(queue):
            if len(request.token_ids) <= tokens:
                by_bucket[self.buckets.bucket_index(len(request.token_ids))].append(position)
        row_buckets = self.buckets.rows_for(tokens)
        same = by_bucket[index][: row_buckets[-1]]  # starts with the oldest, position 0
        rows = next(r for r in row_buckets if r >= len(same))
        shorter = [position for bucket in reversed(by_bucket[:index]) for position in bucket]
        taken = {*same, *shorter[: rows - len(same)]}
        self.waiting = collections.deque(r for position, r in enumerate(queue) if position not in taken)
        return [r for position, r in enumerate(queue) if position in taken], (rows, tokens)
