"""Workload shapes and arrival schedules, with a word-per-token stand-in tokenizer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench import workloads as w
from bench.load import LoadSpec, arrival_times, num_requests


class WordTokenizer:
    """Token i is the word `w{i}`; encoding splits on spaces."""

    vocab_size = 500

    def encode(self, text: str) -> list[int]:
        return [int(t[1:]) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


def sampler(seed: int = 0) -> w.TokenSampler:
    return w.TokenSampler(WordTokenizer(), seed, special_ids={0, 1, 2})


def test_random_lengths_in_range_and_no_special_tokens():
    wl = w.random_workload(sampler(), 200, input_len=100, output_len=20, range_ratio=0.5)
    lens = [r.prompt_len for r in wl.requests]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 10
    assert all(50 <= len(r.prompt) <= 150 for r in wl.requests)
    assert all(10 <= r.max_tokens <= 30 for r in wl.requests)
    assert not {0, 1, 2} & {t for r in wl.requests for t in r.prompt}


def test_random_is_deterministic_per_seed_and_text_mode_counts_tokens():
    a = w.random_workload(sampler(1), 5, 16, 8)
    b = w.random_workload(sampler(1), 5, 16, 8)
    c = w.random_workload(sampler(2), 5, 16, 8)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests] != [r.prompt for r in c.requests]
    text = w.random_workload(sampler(1), 5, 16, 8, as_text=True)
    assert all(isinstance(r.prompt, str) and r.prompt_len == 16 for r in text.requests)


def test_facts32_shape():
    wl = w.facts32_workload(sampler())
    lens = [r.prompt_len for r in wl.requests]
    assert len(lens) == 32 and min(lens) == 16 and max(lens) == 256
    assert sum(lens) == 4352
    assert {r.max_tokens for r in wl.requests} == {64}


def test_shared_prefix_shares_exact_prefixes_in_mixed_order():
    wl = w.shared_prefix_workload(sampler(), num_prefixes=3, questions_per_prefix=5, prefix_len=40, question_len=8,
                                  output_len=4)  # fmt: skip
    assert len(wl.items) == 15
    by_group: dict[str, set] = {}
    for r in wl.requests:
        by_group.setdefault(r.group, set()).add(tuple(r.prompt[:40]))
        assert r.prompt_len == 48
    assert len(by_group) == 3 and all(len(p) == 1 for p in by_group.values())
    order = [r.group for r in wl.requests]
    assert order != sorted(order)  # interleaved, so concurrent requests share prefixes


def test_long_prompts_are_spread_among_short_ones():
    wl = w.long_prompt_workload(sampler(), num_short=20, short_len=8, num_long=2, long_len=300, output_len=4)
    groups = [r.group for r in wl.requests]
    assert groups.count("long") == 2 and groups.count("short") == 20
    positions = [i for i, g in enumerate(groups) if g == "long"]
    assert 0 < positions[0] < positions[1] < len(groups) - 1
    assert {r.prompt_len for r in wl.requests if r.group == "long"} == {300}


def test_multi_turn_is_only_for_serving():
    wl = w.multi_turn_workload(sampler(), num_sessions=3, turns=4, user_len=5, output_len=6)
    assert wl.is_multi_turn and num_requests(wl) == 12
    with pytest.raises(ValueError, match="served"):
        _ = wl.requests


def test_jsonl_workload(tmp_path):
    path = tmp_path / "wl.jsonl"
    lines = [{"prompt": "w5 w6 w7", "max_tokens": 3, "group": "g"}, {"prompt": [9, 10]},
             {"turns": ["w3", "w4"], "system": "w8", "max_tokens": 2}]  # fmt: skip
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    wl = w.jsonl_workload(path, WordTokenizer(), default_max_tokens=7)
    first, second, third = wl.items
    assert (first.prompt_len, first.max_tokens, first.group) == (3, 3, "g")
    assert (second.prompt, second.max_tokens) == ([9, 10], 7)
    assert isinstance(third, w.Conversation) and third.turns == ["w3", "w4"] and third.system == "w8"
    path.write_text('{"prompt": 5}\n')
    with pytest.raises(ValueError, match=":1:"):
        w.jsonl_workload(path, WordTokenizer())


def test_poisson_arrivals_have_the_requested_rate_and_unpaced_start_together():
    times = arrival_times(4000, request_rate=20.0, seed=0)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # exponential: std == mean
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 5.0, 7) == arrival_times(50, 5.0, 7)


def test_load_spec_validation():
    with pytest.raises(ValueError):
        LoadSpec(request_rate=0)
    with pytest.raises(ValueError):
        LoadSpec(max_concurrency=0)
    with pytest.raises(ValueError):
        LoadSpec(multi_turn_api="telepathy")
