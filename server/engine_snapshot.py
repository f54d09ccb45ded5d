"""A consistent picture of the engine's state, taken on the engine thread between steps.

Used by `/metrics` and by tests that check that nothing is left behind (no request in the
engine, no KV block held by a request). Take it with `await async_engine.call(take_snapshot)`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.dp_router import DataParallelRouter
from jaxserve.kv import KVUsage
from jaxserve.request import RequestStatus


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One data-parallel replica's share: how the router spread the work."""

    running: int
    waiting: int
    kv_used: int
    kv_blocks: int


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """Summed over the data-parallel replicas (`replicas` has each one's load)."""

    running: int
    waiting: int
    swapped: int
    preempted: int  # waiting to resume after a preemption (recompute) or swapped out
    has_unfinished: bool
    kv_requests: int  # requests holding KV block tables
    kv: KVUsage
    prefix_query_tokens: int
    prefix_hit_tokens: int  # from device or host tier: not recomputed
    num_preemptions: int
    num_compilations: int
    num_steps: int
    prompt_tokens_computed: int
    generated_tokens: int
    replicas: tuple[ReplicaLoad, ...]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def take_snapshot(router: DataParallelRouter) -> EngineSnapshot:
    replicas = router.replicas
    scheds = [e.scheduler for e in replicas]
    kv_stats = [e.kv.stats for e in replicas]
    usages = [e.kv.usage() for e in replicas]
    preempted_waiting = sum(1 for s in scheds for r in s.waiting if r.status is RequestStatus.PREEMPTED)
    swapped = sum(len(s.swapped) for s in scheds)
    return EngineSnapshot(
        running=sum(len(s.running) for s in scheds),
        waiting=sum(len(s.waiting) for s in scheds),
        swapped=swapped,
        preempted=preempted_waiting + swapped,
        has_unfinished=router.has_unfinished_requests(),
        kv_requests=sum(len(e.kv.request_ids()) for e in replicas),
        kv=KVUsage.total(usages),
        prefix_query_tokens=sum(s.query_tokens for s in kv_stats),
        prefix_hit_tokens=sum(s.hit_tokens + s.host_hit_tokens for s in kv_stats),
        num_preemptions=sum(s.num_preemptions for s in scheds),
        num_compilations=router.num_compilations,
        num_steps=sum(e.stats.num_steps for e in replicas),
        prompt_tokens_computed=sum(e.stats.prompt_tokens_computed for e in replicas),
        generated_tokens=sum(e.stats.generated_tokens for e in replicas),
        replicas=tuple(ReplicaLoad(len(sched.running), len(sched.waiting), usage.used, usage.num_blocks)
                       for sched, usage in zip(scheds, usages)),
    )
