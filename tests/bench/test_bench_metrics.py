"""Metric definitions on synthetic client timestamps (no server, no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.metrics import SLO, RequestRecord, compute_metrics, metrics_by_group, summarize


def record(start: float, chunks: list[float], end: float, tokens: int, prompt: int = 10, **kw) -> RequestRecord:
    return RequestRecord(start=start, end=end, chunk_times=chunks, output_tokens=tokens, prompt_tokens=prompt, **kw)


def test_ttft_itl_e2el_tpot_of_one_request():
    # sent at 1.0; chunks at 1.3, 1.4, 1.6, 1.7; stream ends at 1.75; 4 tokens
    r = record(1.0, [1.3, 1.4, 1.6, 1.7], 1.75, tokens=4)
    assert r.ttft == pytest.approx(0.3)
    assert r.itl == pytest.approx([0.1, 0.2, 0.1])
    assert r.e2el == pytest.approx(0.75)
    assert r.tpot == pytest.approx((0.75 - 0.3) / 3)


def test_tpot_uses_token_count_not_chunk_count():
    # two chunks carrying 5 tokens in all (server batched text): TPOT divides by tokens - 1
    r = record(0.0, [0.5, 1.0], 1.0, tokens=5)
    assert r.tpot == pytest.approx(0.5 / 4)
    assert r.itl == pytest.approx([0.5])


def test_one_token_request_has_no_tpot_but_passes_the_tpot_slo():
    r = record(0.0, [0.2], 0.2, tokens=1)
    assert r.tpot is None
    assert SLO(ttft_ms=250, tpot_ms=1).is_met(r)
    assert not SLO(ttft_ms=150, tpot_ms=None).is_met(r)


def test_failed_request_never_meets_an_slo_and_is_not_counted():
    bad = record(0.0, [], 0.5, tokens=0, success=False, error="HTTP 500")
    good = record(0.0, [0.1, 0.2], 0.2, tokens=2)
    assert not SLO().is_met(bad)
    m = compute_metrics([bad, good], duration_s=2.0, slo=SLO(ttft_ms=1000))
    assert m["completed"] == 1 and m["failed"] == 1
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["slo_attainment"] == pytest.approx(0.5)
    assert m["mean_ttft_ms"] == pytest.approx(100.0)


def test_throughputs_and_goodput_over_the_duration():
    # 4 requests in a 2 s run; TTFT 100/200/300/400 ms; 11 tokens each at a constant 50 ms gap
    records = [record(0.0, [t + 0.05 * k for k in range(11)], t + 0.5, tokens=11, prompt=20)
               for t in (0.1, 0.2, 0.3, 0.4)]  # fmt: skip
    m = compute_metrics(records, duration_s=2.0, slo=SLO(ttft_ms=250, tpot_ms=50.0 + 1e-6))
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(44 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((44 + 80) / 2.0)
    assert m["mean_tpot_ms"] == pytest.approx(50.0)
    assert m["median_itl_ms"] == pytest.approx(50.0)
    # only the requests with TTFT 100 and 200 ms meet a 250 ms TTFT limit
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    strict_tpot = compute_metrics(records, 2.0, SLO(ttft_ms=None, tpot_ms=49.0))
    assert strict_tpot["request_goodput"] == 0.0


def test_percentiles_are_linear_interpolation_in_ms():
    values_s = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    s = summarize(values_s, "ttft", (50, 90, 99))
    assert s["median_ttft_ms"] == pytest.approx(50.5)
    assert s["p90_ttft_ms"] == pytest.approx(90.1)
    assert s["p99_ttft_ms"] == pytest.approx(99.01)
    assert s["mean_ttft_ms"] == pytest.approx(50.5)
    assert s["std_ttft_ms"] == pytest.approx(float(np.std(np.arange(1, 101))))


def test_empty_lists_give_none_not_zero():
    s = summarize([], "tpot")
    assert all(v is None for v in s.values())


def test_itl_is_pooled_over_requests():
    a = record(0.0, [0.1, 0.2], 0.2, tokens=2)  # gap 100 ms
    b = record(0.0, [0.1, 0.4, 0.7], 0.7, tokens=3)  # gaps 300, 300 ms
    m = compute_metrics([a, b], 1.0)
    assert m["mean_itl_ms"] == pytest.approx(700 / 3)
    assert m["median_itl_ms"] == pytest.approx(300)


def test_cached_tokens_give_prefill_tokens_computed():
    a = record(0.0, [0.1], 0.1, tokens=1, prompt=100, cached_tokens=96)
    b = record(0.0, [0.1], 0.1, tokens=1, prompt=100, cached_tokens=0)
    m = compute_metrics([a, b], 1.0)
    assert m["total_cached_prompt_tokens"] == 96
    assert m["prefill_tokens_computed"] == 104
    unknown = compute_metrics([record(0.0, [0.1], 0.1, tokens=1)], 1.0)
    assert unknown["prefill_tokens_computed"] is None


def test_metrics_by_group():
    short = [record(0.0, [0.1], 0.2, tokens=2, group="short") for _ in range(3)]
    long = [record(0.0, [2.0], 2.1, tokens=2, group="long")]
    groups = metrics_by_group(short + long, 3.0)
    assert set(groups) == {"short", "long"}
    assert groups["short"]["completed"] == 3
    assert groups["long"]["p99_ttft_ms"] == pytest.approx(2000.0)


def test_slo_parse():
    assert SLO.parse("500,100") == SLO(500.0, 100.0)
    assert SLO.parse(",100") == SLO(None, 100.0)
    for bad in ("500", "a,b", "-1,5"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)
    assert math.isclose(compute_metrics([], 1.0)["request_throughput"], 0.0)
