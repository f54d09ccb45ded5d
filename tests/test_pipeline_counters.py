"""The pipeline's bubble counters on the host: a step's schedule added up, two replicas' snapshots
summed per stage (as the data-parallel and cluster routers do, the latter through JSON), and their
Prometheus text. The counters of a real pipelined engine: tests/sharding/test_pipeline_parallel.py."""

from __future__ import annotations

import numpy as np

from jaxserve.engine_snapshot import EngineSnapshot, KVUsage
from jaxserve.runner.step_counters import PipelineTicks
from server.cluster.worker.wire import snapshot_from_json, snapshot_to_json
from server.metrics import ServerMetrics

# GPipe, 2 stages, 2 micro-batches; then 2 stages, 1 micro-batch (one decode row).
TWO_BY_TWO = np.array([[0, 1, -1], [-1, 0, 1]], np.int32)
TWO_BY_ONE = np.array([[0, -1], [-1, 0]], np.int32)


def snapshot(ticks: PipelineTicks) -> EngineSnapshot:
    usage = KVUsage(
        num_blocks=8,
        free=8,
        used=0,
        shared=0,
        cached=0,
        cached_idle=0,
        pinned=0,
        host_slots=0,
        host_swapped=0,
        host_cached=0,
        host_free=0,
    )
    return EngineSnapshot(
        running=0,
        waiting=0,
        swapped=0,
        preempted=0,
        has_unfinished=False,
        kv_requests=0,
        kv=usage,
        prefix_query_tokens=0,
        prefix_hit_tokens=0,
        num_preemptions=0,
        num_compilations=0,
        num_steps=0,
        prompt_tokens_computed=0,
        generated_tokens=0,
        replicas=(),
        pipeline_stage_busy_ticks=tuple(int(n) for n in ticks.busy),
        pipeline_ticks=ticks.ticks,
    )


def test_ticks_add_up_per_stage():
    ticks = PipelineTicks(2)
    ticks.add(TWO_BY_TWO)
    ticks.add(TWO_BY_ONE)
    assert ticks.busy.tolist() == [3, 3] and ticks.ticks == 5
    assert snapshot(ticks).pipeline_bubble_fraction == 4 / 10


def test_replicas_sum_per_stage_and_metrics_show_them():
    a, b = PipelineTicks(2), PipelineTicks(2)
    a.add(TWO_BY_TWO)
    b.add(TWO_BY_ONE)
    total = EngineSnapshot.total([snapshot(a), snapshot_from_json(snapshot_to_json(snapshot(b)))])
    assert total.pipeline_stage_busy_ticks == (3, 3) and total.pipeline_ticks == 5
    text = ServerMetrics().render(total, engine_alive=True).decode()
    assert 'jaxserve_pipeline_stage_busy_ticks_total{stage="1"} 3.0' in text
    assert 'jaxserve_pipeline_stage_idle_ticks_total{stage="0"} 2.0' in text
    assert "jaxserve_pipeline_bubble_fraction 0.4" in text


def test_no_pipeline_no_pipeline_metrics():
    text = ServerMetrics().render(snapshot(PipelineTicks(0)), engine_alive=True).decode()
    assert "jaxserve_pipeline" not in text and "jaxserve_engine_steps" in text
