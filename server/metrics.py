"""Prometheus metrics: request latencies and token counts (asyncio side), engine state (snapshot).

Each server has its own `CollectorRegistry`, so several servers (tests) can live in one process.
Engine gauges come from an `EngineSnapshot` taken on the engine thread for each scrape, so they
are consistent with each other; the step-time histogram is fed by the engine loop's `on_step`
hook (prometheus-client metrics are thread-safe).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine_snapshot import KV_LOAD_SECONDS_BUCKETS, EngineSnapshot, TierStats

PREFIX = "jaxserve"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """Exports the last engine snapshot (set just before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.engine_alive = False

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}_engine_alive", "1 while the engine loop runs", value=int(self.engine_alive))
        s = self.snapshot
        if s is None:
            return
        yield from _state_metrics(s)
        yield from _counter_metrics(s)
        yield from _tier_metrics(s)
        yield from _transfer_metrics(s)
        yield from _expert_metrics(s)
        yield from _lora_metrics(s)
        yield from _pipeline_metrics(s)
        yield from _replica_metrics(s)


def _state_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """Sequences by state, KV blocks by state, usage and the prefix cache's hit rate."""
    requests = GaugeMetricFamily(f"{PREFIX}_num_requests", "Sequences in the engine by state", labels=["state"])
    requests.add_metric(["running"], s.running)
    requests.add_metric(["waiting"], s.waiting)
    requests.add_metric(["swapped"], s.swapped)
    requests.add_metric(["preempted"], s.preempted)
    yield requests
    blocks = GaugeMetricFamily(f"{PREFIX}_kv_blocks", "KV cache blocks by state", labels=["state"])
    for state in ("used", "free", "cached", "cached_idle", "pinned"):
        blocks.add_metric([state], getattr(s.kv, state))
    yield blocks
    yield GaugeMetricFamily(f"{PREFIX}_kv_blocks_total", "Usable KV cache blocks", value=s.kv.num_blocks)
    yield GaugeMetricFamily(
        f"{PREFIX}_kv_usage_ratio",
        "Fraction of KV blocks held by requests",
        value=s.kv.used / s.kv.num_blocks if s.kv.num_blocks else 0.0,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache / prompt tokens queried",
        value=s.prefix_hit_rate,
    )


def _counter_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """Counters since the start: prefix-cache tokens, preemptions, compilations, steps, speculation."""
    yield CounterMetricFamily(
        f"{PREFIX}_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        value=s.prefix_query_tokens,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", value=s.prefix_hit_tokens
    )
    yield CounterMetricFamily(f"{PREFIX}_preemptions", "Requests preempted by the scheduler", value=s.num_preemptions)
    yield CounterMetricFamily(f"{PREFIX}_compilations", "XLA compilations of step functions", value=s.num_compilations)
    yield CounterMetricFamily(f"{PREFIX}_engine_steps", "Engine steps run", value=s.num_steps)
    yield CounterMetricFamily(
        f"{PREFIX}_prompt_tokens_computed",
        "Prompt tokens computed (not served from cache)",
        value=s.prompt_tokens_computed,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_steps", "Engine steps that verified speculative drafts", value=s.speculative_steps
    )
    yield from _speculative_metrics(s)


def _speculative_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """Speculative decoding: drafts verified and accepted (in all and per draft position), tokens accepted
    per draft, the time spent drafting, and the draft lengths chosen."""
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding)", value=s.draft_tokens
    )
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_accepted_tokens", "Draft tokens accepted by verification", value=s.accepted_tokens
    )
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_num_drafts", "Drafts verified (decodes that carried one)", value=s.num_drafts
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_spec_decode_mean_accepted_tokens",
        "Draft tokens accepted per verified draft, since the start",
        value=s.mean_accepted_tokens,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_draft_seconds", "Seconds spent drafting (the proposer)", value=s.draft_seconds
    )
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_chosen_draft_tokens",
        "Draft lengths chosen, summed over decode steps (adaptive_draft_length)",
        value=s.chosen_draft_tokens,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_spec_decode_draft_length_steps",
        "Decode steps a draft length was counted for (0: drafting off)",
        value=s.draft_length_steps,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_spec_decode_mean_draft_length",
        "Draft length chosen per decode step (0: drafting off; adaptive_draft_length), since the start",
        value=s.mean_draft_length,
    )
    drafted = CounterMetricFamily(
        f"{PREFIX}_spec_decode_position_draft_tokens", "Drafts with a token at this position", labels=["position"]
    )
    accepted = CounterMetricFamily(
        f"{PREFIX}_spec_decode_position_accepted_tokens", "Draft tokens accepted at this position", labels=["position"]
    )
    rate = GaugeMetricFamily(
        f"{PREFIX}_spec_decode_position_acceptance_rate",
        "Accepted / drafted tokens at this draft position, since the start",
        labels=["position"],
    )
    for j, (n, a) in enumerate(zip(s.position_drafts, s.position_accepted)):
        drafted.add_metric([str(j)], n)
        accepted.add_metric([str(j)], a)
        rate.add_metric([str(j)], a / n if n else 0.0)
    yield from (drafted, accepted, rate)


def _replica_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """Per data-parallel replica: sequences by state and KV usage."""
    per_replica = GaugeMetricFamily(
        f"{PREFIX}_replica_num_requests",
        "Sequences per data-parallel replica by state",
        labels=["replica", "state"],
    )
    kv_per_replica = GaugeMetricFamily(
        f"{PREFIX}_replica_kv_usage_ratio",
        "Fraction of a data-parallel replica's KV blocks held by requests",
        labels=["replica"],
    )
    for i, r in enumerate(s.replicas):
        per_replica.add_metric([str(i), "running"], r.running)
        per_replica.add_metric([str(i), "waiting"], r.waiting)
        kv_per_replica.add_metric([str(i)], r.kv_used / r.kv_blocks if r.kv_blocks else 0.0)
    yield per_replica
    yield kv_per_replica


def _expert_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """A mixture-of-experts model's routing, per expert (summed over layers and replicas)."""
    if not s.expert_tokens:
        return
    tokens = CounterMetricFamily(
        f"{PREFIX}_moe_expert_tokens",
        "Token-to-expert assignments routed to each expert (all layers)",
        labels=["expert"],
    )
    load = GaugeMetricFamily(
        f"{PREFIX}_moe_expert_load",
        "Token-to-expert assignments of each expert in the last model step (all layers)",
        labels=["expert"],
    )
    for expert, (total, last) in enumerate(zip(s.expert_tokens, s.expert_load)):
        tokens.add_metric([str(expert)], total)
        load.add_metric([str(expert)], last)
    yield tokens
    yield load


def _lora_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """LoRA adapters: LoRA slots in use, loads, requests per adapter (summed over replicas)."""
    yield GaugeMetricFamily(f"{PREFIX}_lora_resident_adapters", "LoRA adapters in LoRA slots", value=s.lora_resident)
    yield CounterMetricFamily(
        f"{PREFIX}_lora_disk_loads", "LoRA adapters read from disk into host memory", value=s.lora_disk_loads
    )
    yield CounterMetricFamily(
        f"{PREFIX}_lora_device_loads", "LoRA adapters written into a LoRA slot", value=s.lora_device_loads
    )
    requests = CounterMetricFamily(f"{PREFIX}_lora_requests", "Requests run with each LoRA adapter", labels=["adapter"])
    for name, count in s.lora_requests:
        requests.add_metric([name], count)
    yield requests


def _pipeline_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """Pipeline stages: per stage, the schedule's ticks it ran a micro-batch in and those it waited
    (summed over replicas), and the bubble: idle stage-ticks / all stage-ticks since the start."""
    if not s.pipeline_stage_busy_ticks:
        return
    busy = CounterMetricFamily(
        f"{PREFIX}_pipeline_stage_busy_ticks",
        "Schedule ticks in which each pipeline stage ran a micro-batch",
        labels=["stage"],
    )
    idle = CounterMetricFamily(
        f"{PREFIX}_pipeline_stage_idle_ticks",
        "Schedule ticks in which each pipeline stage waited (the pipeline bubble)",
        labels=["stage"],
    )
    for stage, ran in enumerate(s.pipeline_stage_busy_ticks):
        busy.add_metric([str(stage)], ran)
        idle.add_metric([str(stage)], s.pipeline_ticks - ran)
    yield busy
    yield idle
    yield GaugeMetricFamily(
        f"{PREFIX}_pipeline_bubble_fraction",
        "Idle stage-ticks / all stage-ticks of the pipeline's schedules since the start",
        value=s.pipeline_bubble_fraction,
    )


def _tier_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """Per-tier counters of the KV cache: device, host and each tier below the host tier (disk, pool)."""
    t = s.tiers
    lower = t.lower_tier_names
    hits = CounterMetricFamily(
        f"{PREFIX}_kv_tier_hit_tokens",
        "Prompt tokens served from each KV tier (host includes what the tiers below it loaded)",
        labels=["tier"],
    )
    for tier, value in (("device", t.device_hit_tokens), ("host", t.host_hit_tokens)):
        hits.add_metric([tier], value)
    for kind in lower:
        hits.add_metric([kind], getattr(t, f"{kind}_hit_tokens"))
    yield hits
    evictions = CounterMetricFamily(f"{PREFIX}_kv_tier_evictions", "Blocks evicted from each KV tier", labels=["tier"])
    for tier, value in (("device", t.device_evictions), ("host", t.host_evictions)):
        evictions.add_metric([tier], value)
    for kind in lower:
        evictions.add_metric([kind], getattr(t, f"{kind}_evictions"))
    yield evictions
    for kind in lower:
        yield from _lower_tier_metrics(t, kind)


def _lower_tier_metrics(t: TierStats, kind: str) -> Iterator[Metric]:
    """One tier below the host tier's counters, under its own name (`kv_disk_*`, `kv_pool_*`)."""

    def field(name: str) -> Any:
        return getattr(t, f"{kind}_{name}")

    io_bytes = CounterMetricFamily(
        f"{PREFIX}_kv_{kind}_io_bytes", f"Bytes of KV blocks the {kind} tier read and wrote", labels=["direction"]
    )
    io_bytes.add_metric(["read"], field("bytes_read"))
    io_bytes.add_metric(["written"], field("bytes_written"))
    yield io_bytes
    yield _load_histogram(
        f"{PREFIX}_kv_{kind}_load_duration_seconds",
        f"Wall time of each background load from the {kind} tier",
        field("load_seconds_counts"),
        field("load_seconds"),
    )
    yield CounterMetricFamily(
        f"{PREFIX}_kv_{kind}_write_seconds",
        f"Summed wall time of block writes to the {kind} tier",
        value=field("write_seconds"),
    )
    yield CounterMetricFamily(
        f"{PREFIX}_kv_{kind}_damaged_files",
        f"Damaged blocks (files, pool objects) the {kind} tier found and deleted",
        value=field("damaged"),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_kv_{kind}_bytes", f"Bytes of KV blocks the {kind} tier holds", value=field("bytes")
    )


def _load_histogram(name: str, documentation: str, counts: tuple[int, ...], total_seconds: float) -> Metric:
    """A histogram over KV_LOAD_SECONDS_BUCKETS from per-bucket counts (the last: above them)."""
    cumulative = list(itertools.accumulate(counts))
    return HistogramMetricFamily(
        name,
        documentation,
        sum_value=total_seconds,
        buckets=[*zip(map(str, KV_LOAD_SECONDS_BUCKETS), cumulative), ("+Inf", cumulative[-1])],
    )


def _transfer_metrics(s: EngineSnapshot) -> Iterator[Metric]:
    """KV moved from prefill to decode workers (a disaggregating router); per request = total / transfers."""
    t = s.kv_transfer
    yield CounterMetricFamily(
        f"{PREFIX}_kv_transfers", "Prompts whose KV a decode worker pulled from a prefill worker", value=t.transfers
    )
    yield CounterMetricFamily(
        f"{PREFIX}_kv_device_transfers",
        "Of them, those whose blocks moved device to device (jax.experimental.transfer, --kv-transport device)",
        value=t.device_transfers,
    )
    blocks = CounterMetricFamily(
        f"{PREFIX}_kv_transfer_blocks",
        "KV blocks of handed-over prompts: pulled, or skipped (the decode worker's prefix cache had them)",
        labels=["kind"],
    )
    blocks.add_metric(["pulled"], t.blocks_pulled)
    blocks.add_metric(["skipped"], t.blocks_skipped)
    yield blocks
    yield CounterMetricFamily(f"{PREFIX}_kv_transfer_bytes", "KV bytes pulled by decode workers", value=t.bytes)
    yield _load_histogram(
        f"{PREFIX}_kv_transfer_duration_seconds",
        "Time of each pull (with the writes into the decode worker's cache)",
        t.seconds_counts,
        t.seconds,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_kv_transfer_failures",
        "Handed-over prompts whose KV did not arrive (recomputed on the decode worker)",
        value=t.failed,
    )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = _EngineCollector()
        r.register(self.engine)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between generated tokens of a choice",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Arrival to the last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            f"{PREFIX}_engine_step_seconds", "Duration of one engine step", buckets=TOKEN_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            f"{PREFIX}_requests", "Generation requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth",
            "Admitted sequences waiting for one of the running slots (--max-num-seqs)",
            registry=r,
        )
        self.queue_wait = Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "Time a request waited in the server's queue for running slots (--max-queue-wait), until it got them",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def observe_step(self, seconds: float) -> None:
        self.step_time.observe(seconds)

    def render(self, snapshot: EngineSnapshot | None, engine_alive: bool) -> bytes:
        self.engine.snapshot = snapshot
        self.engine.engine_alive = engine_alive
        return generate_latest(self.registry)
