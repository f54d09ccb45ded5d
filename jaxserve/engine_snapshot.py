"""A consistent picture of an engine's state, taken on the engine thread between steps.

Used by `/metrics` and by tests that check that nothing is left behind (no request in the
engine, no KV block held by a request). Each replica takes its own (`LLMEngine.snapshot`); the
data-parallel engine sums them (`EngineSnapshot.total`). From the server: `await
async_engine.snapshot()`.
"""

from __future__ import annotations

import dataclasses

from jaxserve.kv import KVUsage
from jaxserve.kv.kv_tier import KV_LOAD_SECONDS_BUCKETS, load_seconds_bucket
from jaxserve.kv.tier_stats import TierStats

__all__ = [
    "KV_LOAD_SECONDS_BUCKETS",
    "EngineSnapshot",
    "KVTransferStats",
    "KVUsage",
    "ReplicaLoad",
    "TierStats",
    "load_seconds_bucket",
]


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One data-parallel replica's share: how placement spread the work."""

    running: int
    waiting: int
    kv_used: int
    kv_blocks: int


@dataclasses.dataclass(frozen=True)
class KVTransferStats:
    """KV moved from prefill to decode workers, as a disaggregating router counts it (from what
    the decode workers report of each pull)."""

    transfers: int = 0  # prompts handed over
    device_transfers: int = 0  # of them, those whose blocks moved device to device
    blocks_pulled: int = 0
    blocks_skipped: int = 0  # the decode worker's prefix cache had them
    bytes: int = 0
    seconds: float = 0.0  # pulls and writes into the decode worker's cache, summed
    # the transfers by that time, a count per bucket of KV_LOAD_SECONDS_BUCKETS and one above them
    seconds_counts: tuple[int, ...] = (0,) * (len(KV_LOAD_SECONDS_BUCKETS) + 1)
    failed: int = 0  # handed over without their KV (recomputed on the decode worker)


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
    tiers: TierStats = TierStats()  # per-tier hits, bytes, load time, evictions
    kv_transfer: KVTransferStats = KVTransferStats()  # a disaggregating router's
    # Speculative decoding: steps that verified drafts, draft tokens verified and accepted, drafts verified
    # (decodes that carried one), per draft position the drafts with a token there and those accepted, and
    # the seconds spent drafting; the draft lengths chosen (0: drafting off) summed over the decode steps.
    speculative_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0
    position_drafts: tuple[int, ...] = ()
    position_accepted: tuple[int, ...] = ()
    draft_seconds: float = 0.0
    chosen_draft_tokens: int = 0
    draft_length_steps: int = 0
    # Mixture of experts, per expert (all layers; empty for a dense model): token-to-expert
    # assignments since the start, and in the last model step read.
    expert_tokens: tuple[int, ...] = ()
    expert_load: tuple[int, ...] = ()
    # LoRA: adapters in LoRA slots now, adapters read from disk and written into LoRA slots since the
    # start, and requests per adapter name (sorted by name).
    lora_resident: int = 0
    lora_disk_loads: int = 0
    lora_device_loads: int = 0
    lora_requests: tuple[tuple[str, int], ...] = ()
    # Pipeline stages, over the model steps read (multi-step loops not counted): per stage, the
    # ticks of the schedule it ran a micro-batch in (busy), and the ticks every stage went through
    # (busy + idle; summed over replicas, as the per-stage counts are).
    pipeline_stage_busy_ticks: tuple[int, ...] = ()
    pipeline_ticks: int = 0

    @classmethod
    def total(cls, snapshots: list[EngineSnapshot]) -> EngineSnapshot:
        """The replicas' snapshots summed (each keeps its load in `replicas`)."""
        per_index = (  # per expert, stage or draft position
            "expert_tokens",
            "expert_load",
            "pipeline_stage_busy_ticks",
            "position_drafts",
            "position_accepted",
        )
        summed = {
            f.name: sum(getattr(s, f.name) for s in snapshots)
            for f in dataclasses.fields(cls)
            if f.name not in ("has_unfinished", "kv", "replicas", "tiers", "kv_transfer", "lora_requests", *per_index)
        }
        indexed = {
            name: tuple(sum(counts) for counts in zip(*(getattr(s, name) for s in snapshots))) for name in per_index
        }
        lora_requests: dict[str, int] = {}
        for s in snapshots:
            for name, count in s.lora_requests:
                lora_requests[name] = lora_requests.get(name, 0) + count
        return cls(
            **summed,
            **indexed,
            lora_requests=tuple(sorted(lora_requests.items())),
            has_unfinished=any(s.has_unfinished for s in snapshots),
            kv=KVUsage.total([s.kv for s in snapshots]),
            replicas=tuple(r for s in snapshots for r in s.replicas),
            tiers=TierStats.total([s.tiers for s in snapshots]),
        )

    @property
    def mean_accepted_tokens(self) -> float:
        """Draft tokens accepted per verified draft (vLLM's mean acceptance length is one more)."""
        return self.accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_draft_length(self) -> float:
        """The draft length chosen per decode step, 0 counted (`jaxserve.speculative.draft_length`)."""
        return self.chosen_draft_tokens / self.draft_length_steps if self.draft_length_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def pipeline_bubble_fraction(self) -> float:
        """Idle stage-ticks / all stage-ticks of the pipeline's schedules (0 before any)."""
        total = self.pipeline_ticks * len(self.pipeline_stage_busy_ticks)
        return (total - sum(self.pipeline_stage_busy_ticks)) / total if total else 0.0
