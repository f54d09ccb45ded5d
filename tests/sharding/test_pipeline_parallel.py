"""Pipeline stages (`--pipeline-parallel-size`) on a simulated 8-device CPU mesh equal one device.

pp_worker.py builds each layout in a subprocess and reports tokens, compilation counts, KV pool
state, shardings and the schedule the pipelined layers ran; the tests assert on that report. CI
runs one device against pp=3 (uneven stages) with preemption + swap, async scheduling and a
prefix-cache round; the other layouts (the same with multi-step decode, pp2, pp2 x tp2, dp2 x pp2,
and the default model) run the same code and are marked slow.
"""

from __future__ import annotations

import pytest
from mesh_cases import QUICK_COMPILE, run_worker

pytestmark = pytest.mark.timeout(1800)

BASELINE = "tiny+reference:1x1x1"
CI_LAYOUTS = ["tiny+serving:1x3x1"]
SLOW_LAYOUTS = [
    "tiny+serving+multistep:1x3x1",
    "tiny:1x2x1",
    "tiny:1x2x2",
    "tiny:2x2x1",
    "tiny+handoff:1x2x1",
    "tiny+handoff:1x3x1",
]
DEFAULT_LAYOUTS = ["default:1x1x1", "default:1x2x1", "default:1x3x1"]


@pytest.fixture(scope="module")
def report() -> dict:
    return run_worker("pp_worker.py", BASELINE, *CI_LAYOUTS, timeout=1500, xla_flags=QUICK_COMPILE)


@pytest.fixture(scope="module")
def slow_report() -> dict:
    return run_worker("pp_worker.py", BASELINE, *SLOW_LAYOUTS, timeout=1500)


@pytest.fixture(scope="module")
def default_report() -> dict:
    return run_worker("pp_worker.py", *DEFAULT_LAYOUTS, timeout=1500)


def check_layout(report: dict, case: str, baseline: str) -> None:
    r, base = report[case], report[baseline]
    assert r["greedy"] == base["greedy"] and all(len(t) == 8 for t in r["greedy"])
    assert r["again"] == base["greedy"]  # a second round, through the prefix cache
    assert r["seeded"] == base["seeded"]
    assert r["kv_leaks"] == []
    warm, after = r["compilations"]
    assert warm > 0 and after == warm and r["xla_compilations_while_serving"] == 0
    dp, pp, tp = map(int, case.split(":")[1].split("x"))
    assert r["cache_spec"] == ("('pp', 'tp')" if pp > 1 else "(None, 'tp')")
    assert len(r["layer_devices"]) == pp * tp  # each replica's layers on its own pp x tp devices


def check_schedule(schedule: list[list[int]], stages: int, micro: int) -> None:
    """GPipe: stage s runs micro-batch t - s at tick t; while stage s + 1 runs k, stage s runs k + 1."""
    assert len(schedule) == stages and all(len(row) == micro + stages - 1 for row in schedule)
    for s, row in enumerate(schedule):
        assert row == [t - s if 0 <= t - s < micro else -1 for t in range(micro + stages - 1)]
    overlapped = [
        (t, s)
        for t in range(micro + stages - 1)
        for s in range(stages - 1)
        if schedule[s + 1][t] >= 0 and schedule[s + 1][t] == schedule[s][t] - 1
    ]
    assert len(overlapped) == (stages - 1) * (micro - 1)
    idle = sum(row.count(-1) for row in schedule)
    assert idle / (stages * (micro + stages - 1)) == pytest.approx((stages - 1) / (micro + stages - 1))


@pytest.mark.parametrize("case", CI_LAYOUTS)
def test_pp3_serving_equals_one_device(report, case):
    check_layout(report, case, BASELINE)
    assert report[case]["preemptions"] > 0  # the swap path ran
    assert report[case]["cache_shard_shape"][0] == 2  # 4 layers over 3 stages: 2 | 1 + identity | 1 + identity


def test_micro_batches_overlap_across_stages(report):
    schedules = report["tiny+serving:1x3x1"]["schedules"]
    check_schedule(schedules["decode"], stages=3, micro=3)
    check_schedule(schedules["prefill"], stages=3, micro=3)


def test_engine_counts_the_bubble(report):
    """The runner adds up the schedule of every model step it reads: here each step has 3
    micro-batches over 3 stages, 5 ticks, each stage busy in 3 of them (bubble 2/5)."""
    r = report["tiny+serving:1x3x1"]["pipeline_counters"]
    steps = r["model_steps"]
    assert steps > 0
    assert r["busy"] == [3 * steps] * 3 and r["ticks"] == 5 * steps
    assert r["bubble_fraction"] == pytest.approx(2 / 5)
    for stage in range(3):
        assert f'jaxserve_pipeline_stage_busy_ticks_total{{stage="{stage}"}} {float(3 * steps)}' in r["metrics"]
        assert f'jaxserve_pipeline_stage_idle_ticks_total{{stage="{stage}"}} {float(2 * steps)}' in r["metrics"]
    assert "jaxserve_pipeline_bubble_fraction 0.4" in r["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_LAYOUTS[:4])
def test_layout_equals_one_device(slow_report, case):
    check_layout(slow_report, case, BASELINE)
    if "serving" in case:
        assert slow_report[case]["preemptions"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny:1x2x1", "tiny:2x2x1"])
def test_two_stages_two_micro_batches(slow_report, case):
    check_schedule(slow_report[case]["schedules"]["decode"], stages=2, micro=2)
    check_schedule(slow_report[case]["schedules"]["prefill"], stages=2, micro=2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny+handoff:1x2x1", "tiny+handoff:1x3x1"])
def test_engines_of_other_stage_counts_hand_kv_to_each_other(slow_report, case):
    """Even (2 stages of 2 layers) and uneven (3 stages: 2, 1, 1 layers and two identity layers)
    prefill engines hand a prompt's blocks to one device and back, one row per model layer."""
    r = slow_report[case]
    assert r["handoff_keys_match"]  # both sides key the handed blocks alike
    assert r["disk_keys_match"] == (case.endswith("1x2x1"))  # files keep the cache's own layer positions
    for direction in ("to_one", "from_one"):
        d = r[direction]
        assert d["handed_blocks"] == d["written_blocks"] == 8 and d["same_bytes"] and d["layers"] == 4
        assert d["dest_tokens"] == d["source_tokens"] and len(d["dest_tokens"]) == 8
        assert d["dest_prompt_tokens_computed"] == 70 - 8 * 8  # a prefix hit on the handed blocks
    assert r["kv_leaks"] == []


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", DEFAULT_LAYOUTS[1:])
def test_default_model_layout_equals_one_device(default_report, case):
    check_layout(default_report, case, DEFAULT_LAYOUTS[0])
