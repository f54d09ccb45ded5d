"""Result tables, ratios and `compare` on hand-made result dicts."""

from __future__ import annotations

import json

import pytest

from bench.report import compare, higher_is_better, ratios, table, with_ratios


def result(throughput: float, ttft: float, cpu: str = "x") -> dict:
    return {
        "kind": "serve",
        "model": "m",
        "dtype": "float32",
        "config": {},
        "workload": {"name": "random"},
        "run": {},
        "system": {"cpu": cpu},
        "backends": {
            "jaxserve": {"results": {"output_throughput": throughput, "median_ttft_ms": ttft, "completed": 4}},
            "llama-cpp": {"results": {"output_throughput": 50.0, "median_ttft_ms": 20.0, "completed": 4}},
        },
    }


def test_ratio_is_ours_over_peer_and_the_verdict_knows_the_direction():
    r = with_ratios(result(100.0, 40.0))
    assert r["ratios"]["llama-cpp"] == {"output_throughput": 2.0, "median_ttft_ms": 2.0, "completed": 1.0}
    text = table(
        "t", {"jaxserve": r["backends"]["jaxserve"]["results"], "llama-cpp": r["backends"]["llama-cpp"]["results"]}
    )
    rows = {line.split()[0]: line for line in text.splitlines() if line and line.split()[0] in r["ratios"]["llama-cpp"]}
    assert rows["output_throughput"].endswith("2.00x better")  # higher throughput is better
    assert rows["median_ttft_ms"].endswith("2.00x worse")  # higher latency is worse
    assert "better" not in rows["completed"] and "worse" not in rows["completed"]


def test_direction_of_keys():
    assert higher_is_better("output_throughput") and higher_is_better("request_goodput")
    assert higher_is_better("p99_ttft_ms") is False and higher_is_better("elapsed_s") is False
    assert higher_is_better("mean_decode_ms_per_token") is False and higher_is_better("decode_tokens_per_s")
    assert higher_is_better("completed") is None


def test_ratios_skip_missing_and_zero():
    assert ratios({"a": 1.0, "b": 2.0, "c": None}, {"a": 0.0, "b": 4.0, "c": 1.0}) == {"b": 0.5}


def test_compare_files(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(result(100.0, 40.0)))
    b.write_text(json.dumps(result(50.0, 40.0, cpu="y")))
    text = compare(a, b)
    assert "system cpu differs" in text
    line = next(l for l in text.splitlines() if l.startswith("output_throughput"))
    assert "2.00" in line and line.endswith("2.00x better")
    with pytest.raises(FileNotFoundError):
        compare(a, tmp_path / "missing.json")
