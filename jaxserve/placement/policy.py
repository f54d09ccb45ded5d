"""Cache-aware placement, after SGLang's router: which target (an engine replica or a worker) a
prompt goes to.

A request goes to the target whose prefix cache holds the longest match of its prompt when that
match covers enough of the prompt and the targets' loads are not too far apart; otherwise to the
least-loaded one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PlacementPolicy:
    """When a prefix hit outweighs load balance. The defaults are SGLang's router's.

    A target's cached prefix counts when it covers at least `match_fraction` of the prompt.
    Loads count as imbalanced (place by load alone) when the busiest target has more than
    `balance_abs` sequences over the idlest and more than `balance_rel` times its load.
    """

    match_fraction: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5
    # A router over worker processes cannot see their LoRA slots: it takes the adapters of the
    # last requests it sent a worker, this many distinct ones (the workers' --max-loras), as
    # resident there. The in-process engine asks its replicas instead.
    adapter_slots: int = 1
    # A router follows its workers' KV events (what their prefix caches hold) besides its own picture
    # of what it sent them; False: its picture alone (SGLang's approximate tree).
    kv_events: bool = True


def choose_target(
    matches: Sequence[int],
    loads: Sequence[int],
    prompt_len: int,
    policy: PlacementPolicy,
    resident: Sequence[bool] | None = None,
) -> int:
    """Index of the target for a prompt of `prompt_len` tokens, given each target's cached
    prefix length (`matches`) and load. Ties go to the less loaded, then the lower index.

    For a LoRA request, `resident` says which targets hold its adapter in a device slot: unless
    the loads are imbalanced, the choice is made among those (when any), so the request neither
    waits for a slot nor evicts another adapter elsewhere. `matches` must then count the
    adapter's own cached KV, never the base model's or another adapter's."""
    hi, lo = max(loads), min(loads)
    imbalanced = hi - lo > policy.balance_abs and hi > policy.balance_rel * lo
    pool = list(range(len(loads)))
    if resident is not None and any(resident) and not imbalanced:
        pool = [i for i in pool if resident[i]]
    best = max(matches[i] for i in pool)
    if not imbalanced and best > 0 and best >= policy.match_fraction * prompt_len:
        pool = [i for i in pool if matches[i] == best]
    return min(pool, key=lambda i: (loads[i], i))
