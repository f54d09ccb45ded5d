"""Serving metrics from client-side timestamps, with `vllm bench serve`'s definitions and key names.

Per request (all times in seconds on one monotonic clock):
- TTFT: first streamed chunk carrying output minus the send time;
- ITL: gaps between successive output-carrying chunks (pooled over all requests);
- e2e latency (E2EL): end of the stream minus the send time;
- TPOT: (E2EL - TTFT) / (output tokens - 1), defined only for requests with more than one token.
Over a run: request and token throughput over the run's duration, and goodput: the rate of
requests that met every SLO given (a one-token request passes the TPOT SLO, as in vLLM).
Pure Python + numpy, so the definitions are testable on synthetic timestamps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

DEFAULT_PERCENTILES = (90, 99)  # mean and median are always reported
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request."""

    start: float  # when the request was sent
    end: float  # when its stream ended (or failed)
    chunk_times: list[float]  # arrival time of every chunk that carried output text
    output_tokens: int
    prompt_tokens: int
    success: bool = True
    error: str = ""
    group: str = ""  # workload label ("short", "long", "turn-2+", ...)
    cached_tokens: int | None = None  # prompt tokens the server reused (usage.prompt_tokens_details)
    output_text: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class SLO:
    """Service-level objective; a request is good when it meets every limit that is set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`"500,100"` -> TTFT <= 500 ms and TPOT <= 100 ms; an empty field leaves that limit off."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2:
            raise ValueError(f"--slo takes 'ttft_ms,tpot_ms', got {text!r}")
        values = [float(p) if p else None for p in parts]
        if any(v is not None and v <= 0 for v in values):
            raise ValueError(f"SLO limits must be positive, got {text!r}")
        return cls(*values)

    def is_met(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_ms is not None and (record.ttft is None or record.ttft * 1e3 > self.ttft_ms):
            return False
        tpot = record.tpot or 0.0  # one-token requests have no TPOT and pass
        return self.tpot_ms is None or tpot * 1e3 <= self.tpot_ms


def summarize(
    values_s: Sequence[float], name: str, percentiles: Iterable[float] = DEFAULT_PERCENTILES
) -> dict[str, float | None]:
    """mean / median / std / pXX of a latency list given in seconds, reported in ms (None if empty)."""
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, float | None] = {}
    empty = arr.size == 0
    out[f"mean_{name}_ms"] = None if empty else float(arr.mean())
    out[f"median_{name}_ms"] = None if empty else float(np.median(arr))
    out[f"std_{name}_ms"] = None if empty else float(arr.std())
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = None if empty else float(np.percentile(arr, p))
    return out


def latency_lists(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The raw per-metric lists in seconds, over successful requests (ITL pooled)."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, float | int | None]:
    """The run's summary: counts, throughputs, goodput and latency statistics (vLLM's keys)."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out: dict[str, float | int | None] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_prompt_tokens": sum(cached) if cached else None,
        "prefill_tokens_computed": input_tokens - sum(cached) if len(cached) == len(ok) and ok else None,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if slo is not None:
        good = sum(slo.is_met(r) for r in records)
        out["request_goodput"] = good / duration_s
        out["slo_attainment"] = good / len(records) if records else None
    for name, values in latency_lists(records).items():
        out.update(summarize(values, name, percentiles))
    return out


def metrics_by_group(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, dict[str, float | int | None]]:  # fmt: skip
    """compute_metrics per workload group label (only when the workload labels its requests)."""
    groups = sorted({r.group for r in records if r.group})
    return {g: compute_metrics([r for r in records if r.group == g], duration_s, slo, percentiles) for g in groups}
