"""The order in which waiting requests are admitted: FCFS, priority, or longest cached prefix first (LPM)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxserve.kv import KVCacheManager
from jaxserve.request import Request

LPM_STARVATION_SECONDS = 5.0  # under LPM, a request waiting longer than this goes first


def waiting_in_policy_order(
    waiting: Iterable[Request], policy: str, priority_key: Callable[[Request], Any], kv: KVCacheManager
) -> list[Request]:
    """`waiting` in admission order under `policy` ("fcfs", "priority" by `priority_key`, or "lpm": the
    longest prefix in `kv`'s cache first, but any request waiting over LPM_STARVATION_SECONDS before)."""
    if policy == "fcfs":
        return list(waiting)
    if policy == "priority":
        return sorted(waiting, key=priority_key)
    now = time.monotonic()
    starving = [r for r in waiting if now - r.arrival_time > LPM_STARVATION_SECONDS]
    rest = [r for r in waiting if now - r.arrival_time <= LPM_STARVATION_SECONDS]
    rest.sort(key=lambda r: (-kv.match_prefix(r.copy_cache_tokens(), r.block_keys).num_tokens, r.arrival_time))
    return starving + rest
