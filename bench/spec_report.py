"""Speculative decoding's counters over one benchmark run: acceptance rate (in all and per draft position),
mean accepted tokens per draft, drafting time, and the mean draft length chosen per decode step. The same keys
whether they come from an engine in this process (`EngineSnapshot` before and after: `bench throughput`) or from
a server's `/metrics` scraped before and after (`bench serve` / `sweep`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxserve.engine_snapshot import EngineSnapshot

PREFIX = "jaxserve_spec_decode"  # the server's metric names (server/metrics.py)


def _summary(
    steps: float,
    drafts: float,
    drafted: float,
    accepted: float,
    seconds: float,
    per_position: list[tuple[float, float]],
    lengths: tuple[float, float],
) -> dict[str, Any] | None:
    if not drafts:
        return None
    return {
        "verify_steps": int(steps),
        "drafts": int(drafts),
        "draft_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_tokens": accepted / drafts,  # per draft; vLLM's mean acceptance length is one more
        "draft_seconds": seconds,
        "mean_draft_length": lengths[0] / lengths[1] if lengths[1] else 0.0,  # chosen per decode step, 0 counted
        **{f"acceptance_rate_position_{j}": a / n if n else 0.0 for j, (n, a) in enumerate(per_position)},
    }


def from_snapshots(before: EngineSnapshot, after: EngineSnapshot) -> dict[str, Any] | None:
    """The run's counters from an engine's snapshots before and after it; None when nothing was drafted."""
    positions = [
        (n1 - n0, a1 - a0)
        for n0, a0, n1, a1 in zip(
            before.position_drafts, before.position_accepted, after.position_drafts, after.position_accepted
        )
    ]
    return _summary(
        after.speculative_steps - before.speculative_steps,
        after.num_drafts - before.num_drafts,
        after.draft_tokens - before.draft_tokens,
        after.accepted_tokens - before.accepted_tokens,
        after.draft_seconds - before.draft_seconds,
        positions,
        (
            after.chosen_draft_tokens - before.chosen_draft_tokens,
            after.draft_length_steps - before.draft_length_steps,
        ),
    )


def from_server_counters(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any] | None:
    """The run's counters from two scrapes of a server's `/metrics` counters (`bench.serve.scrape_counters`);
    None when the server drafted nothing over the run (or has no such counters: a peer)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    positions, j = [], 0
    while f"{PREFIX}_position_draft_tokens_total{{position={j}}}" in after:
        label = f"{{position={j}}}"
        drafted = delta(f"{PREFIX}_position_draft_tokens_total{label}")
        positions.append((drafted, delta(f"{PREFIX}_position_accepted_tokens_total{label}")))
        j += 1
    return _summary(
        delta(f"{PREFIX}_steps_total"),
        delta(f"{PREFIX}_num_drafts_total"),
        delta(f"{PREFIX}_draft_tokens_total"),
        delta(f"{PREFIX}_accepted_tokens_total"),
        delta(f"{PREFIX}_draft_seconds_total"),
        positions,
        (delta(f"{PREFIX}_chosen_draft_tokens_total"), delta(f"{PREFIX}_draft_length_steps_total")),
    )
