"""A consistent picture of the engine's state, taken on the engine thread between steps.

Used by `/metrics` and by tests that check that nothing is left behind (no request in the
engine, no KV block held by a request). Take it with `await async_engine.call(take_snapshot)`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine import LLMEngine
from jaxserve.kv import KVUsage
from jaxserve.request import RequestStatus


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
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

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    sched = engine.scheduler
    stats = engine.kv.stats
    preempted_waiting = sum(1 for r in sched.waiting if r.status is RequestStatus.PREEMPTED)
    return EngineSnapshot(
        running=len(sched.running),
        waiting=len(sched.waiting),
        swapped=len(sched.swapped),
        preempted=preempted_waiting + len(sched.swapped),
        has_unfinished=engine.has_unfinished_requests(),
        kv_requests=len(engine.kv.request_ids()),
        kv=engine.kv.usage(),
        prefix_query_tokens=stats.query_tokens,
        prefix_hit_tokens=stats.hit_tokens + stats.host_hit_tokens,
        num_preemptions=sched.num_preemptions,
        num_compilations=engine.runner.num_compilations,
        num_steps=engine.stats.num_steps,
        prompt_tokens_computed=engine.stats.prompt_tokens_computed,
    )
