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


def choose_replica(matches: Sequence[int], loads: Sequence[int], prompt_len: int, policy: RoutingPolicy) -> int:
    """Index of the replica for a prompt of `prompt_len` tokens, given each replica's cached
    prefix length (`matches`) and load. Ties go to the less loaded, then the lower index."""
    hi, lo = max(loads), min(loads)
    imbalanced = hi - lo > policy.balance_abs and hi > policy.balance_rel * lo
    best = max(matches)
    if not imbalanced and best > 0 and best >= policy.match_fraction * prompt_len:
        candidates = [i for i, m in enumerate(matches) if m == best]
    else:
        candidates = list(range(len(loads)))
    return min(candidates, key=lambda i: (loads[i], i))
