"""Cache-aware placement, after SGLang's router: which replica (or worker) a prompt goes to.

A request goes to the replica whose prefix cache holds the longest match of its prompt when that
match covers enough of the prompt and the replicas' loads are not too far apart; otherwise to the
least-loaded one. Used by the in-process data-parallel engine (`jaxserve.data_parallel`) and by the
router over worker processes (`server.cluster.router`), each with its own policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class RoutingPolicy:
    """When a prefix hit outweighs load balance.

    A replica's cached prefix counts when it covers at least `match_fraction` of the prompt.
    Loads count as imbalanced (route by load alone) when the busiest replica has more than
    `balance_abs` sequences over the idlest and more than `balance_rel` times its load.
    """

    match_fraction: float = 0.5
    balance_abs: int = 16
    balance_rel: float = 1.5
    # A router over worker processes cannot see their LoRA slots: it takes the adapters of the
    # last requests it sent a worker, this many distinct ones (the workers' --max-loras), as
    # resident there. The in-process engine reads its replicas' slots instead.
    adapter_slots: int = 1


def choose_replica(
    matches: Sequence[int],
    loads: Sequence[int],
    prompt_len: int,
    policy: RoutingPolicy,
    resident: Sequence[bool] | None = None,
) -> int:
    """Index of the replica for a prompt of `prompt_len` tokens, given each replica's cached
    prefix length (`matches`) and load. Ties go to the less loaded, then the lower index.

    For a LoRA request, `resident` says which replicas hold its adapter in a device slot: unless
    the loads are imbalanced, the choice is made among those (when any), so the request neither
    waits for a slot nor evicts another adapter elsewhere. `matches` must then count the
    adapter's own cached KV (see `adapter_key`), never the base model's or another adapter's."""
    hi, lo = max(loads), min(loads)
    imbalanced = hi - lo > policy.balance_abs and hi > policy.balance_rel * lo
    pool = list(range(len(loads)))
    if resident is not None and any(resident) and not imbalanced:
        pool = [i for i in pool if resident[i]]
    best = max(matches[i] for i in pool)
    if not imbalanced and best > 0 and best >= policy.match_fraction * prompt_len:
        pool = [i for i in pool if matches[i] == best]
    return min(pool, key=lambda i: (loads[i], i))


def adapter_key(token_ids: Sequence[int], adapter: int | None) -> list[int]:
    """A prompt's ids as a router's prefix tree keys them: a LoRA request's (`adapter`, the
    router's number for the adapter's name, >= 1) behind a negative token no prompt has, so a
    prefix routed with one adapter never matches another's or the base model's."""
    ids = list(token_ids)
    return ids if adapter is None else [-adapter, *ids]
