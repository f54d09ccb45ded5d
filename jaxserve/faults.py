"""Fault injection points, for tests that prove one request's failure stays its own.

The engine calls `check(point, request)` where a request's part of an iteration is handled:
"input" (building its rows of the step's arrays), "sampling" (its sampling settings), "stop"
(the stop checks of its new token) and "detokenize". Nothing is armed in serving, where a check
costs one dictionary lookup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

POINTS = ("input", "sampling", "stop", "detokenize")


class _HasId(Protocol):
    request_id: str


class InjectedFault(RuntimeError):
    """Raised at an armed point for the chosen request."""


_armed: dict[str, str] = {}  # point -> request id


def check(point: str, request: _HasId) -> None:
    if _armed and _armed.get(point) == request.request_id:
        raise InjectedFault(f"injected fault at {point!r} for request {request.request_id!r}")


@contextlib.contextmanager
def inject(point: str, request_id: str) -> Iterator[None]:
    """Raise InjectedFault at `point` whenever the engine handles `request_id` there."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {POINTS}")
    _armed[point] = request_id
    try:
        yield
    finally:
        del _armed[point]
