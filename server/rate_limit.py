"""Per-key rate limits over a sliding one-minute window: requests and generated tokens.

A request is refused (429 with `Retry-After`) when the key already sent `rpm` requests in the
last 60 s, or when the tokens generated for it in the last 60 s reach `tpm`. Generated tokens
are only known afterwards, so they are charged when a request ends and throttle the next ones.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from server.errors import APIError

WINDOW_SECONDS = 60.0


class _Window:
    """(time, amount) events of the last minute, with their running total."""

    __slots__ = ("events", "total")

    def __init__(self) -> None:
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def prune(self, now: float) -> None:
        events = self.events
        while events and events[0][0] <= now - WINDOW_SECONDS:
            self.total -= events.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        self.events.append((now, amount))
        self.total += amount

    def seconds_until_below(self, limit: int, now: float) -> float:
        """How long until the total drops below `limit` as old events leave the window."""
        total = self.total
        for t, amount in self.events:
            total -= amount
            if total < limit:
                return max(t + WINDOW_SECONDS - now, 0.0)
        return 0.0


class RateLimiter:
    def __init__(self, rpm: int = 0, tpm: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self._clock = clock
        self._requests: dict[str, _Window] = {}
        self._tokens: dict[str, _Window] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm)

    def admit(self, owner: str) -> None:
        """Count one request for `owner`, or raise APIError 429 (the request is then not counted)."""
        if not self.enabled:
            return
        now = self._clock()
        if self.tpm:
            tokens = self._window(self._tokens, owner, now)
            if tokens.total >= self.tpm:
                wait = tokens.seconds_until_below(self.tpm, now)
                raise self._refusal(f"rate limit of {self.tpm} generated tokens per minute reached", "tokens", wait)
        if self.rpm:
            requests = self._window(self._requests, owner, now)
            if requests.total >= self.rpm:
                wait = requests.seconds_until_below(self.rpm, now)
                raise self._refusal(f"rate limit of {self.rpm} requests per minute reached", "requests", wait)
            requests.add(now, 1)

    def charge_tokens(self, owner: str, num_tokens: int) -> None:
        if self.tpm and num_tokens > 0:
            now = self._clock()
            self._window(self._tokens, owner, now).add(now, num_tokens)

    @staticmethod
    def _window(windows: dict[str, _Window], owner: str, now: float) -> _Window:
        window = windows.get(owner)
        if window is None:
            window = windows[owner] = _Window()
        window.prune(now)
        return window

    @staticmethod
    def _refusal(message: str, kind: str, wait: float) -> APIError:
        seconds = max(1, math.ceil(wait))
        return APIError(
            429,
            f"{message}; retry in {seconds} s",
            code=f"rate_limit_exceeded_{kind}",
            headers={"Retry-After": str(seconds)},
        )
