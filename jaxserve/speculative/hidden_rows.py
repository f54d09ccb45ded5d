"""The target's last hidden states as the MTP proposer takes them (host side, numpy only): a step's rows of
one request (`HiddenRows`, which the runner reads off each step when the proposer wants them), and the rows a
request's MTP layer has not computed yet (`PendingHidden`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.request import Request


@dataclasses.dataclass(frozen=True)
class HiddenRows:
    """The target's hidden states (before its final norm) at `request`'s positions `position`, `position` + 1,
    ... (one row each, f32[n, E]): the rows of its tokens a step computed, those of rejected drafts left out."""

    request: Request
    position: int
    rows: np.ndarray


class PendingHidden:
    """A request's hidden states by position, as steps deliver them: segments of consecutive positions. A
    segment that starts at or before the end of the ones kept replaces what it overlaps (a recomputed position
    has the same state); positions no step delivered (a prefix-cache hit: the target did not compute them)
    read as zeros."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.segments: list[tuple[int, np.ndarray]] = []

    def add(self, position: int, rows: np.ndarray) -> None:
        kept = [(p, r[: position - p]) for p, r in self.segments if p < position]
        self.segments = [(p, r) for p, r in kept if len(r)] + [(position, rows)]

    def take(self, start: int, count: int) -> np.ndarray:
        """f32[count, E]: the states of positions start .. start + count - 1 (zeros where none came)."""
        out = np.zeros((count, self.width), np.float32)
        for p, r in self.segments:
            lo, hi = max(p, start), min(p + len(r), start + count)
            if lo < hi:
                out[lo - start : hi - start] = r[lo - p : hi - p]
        return out

    def drop_before(self, position: int) -> None:
        """Forget the states of positions below `position` (computed by the MTP layer)."""
        kept = [(p, r) for p, r in self.segments if p + len(r) > position]
        self.segments = [(max(p, position), r[max(0, position - p) :]) for p, r in kept]

    @property
    def num_rows(self) -> int:
        return sum(len(r) for _, r in self.segments)
