"""DeepSeek-V3 (tiny random model) over simulated devices equals one device: tensor parallelism
(the attention heads and kv_b_proj's per-head columns split over `tp`, the latent cache
replicated: it has no heads), and expert parallelism with it (routed experts split over `ep`,
their hidden units and the shared experts' over `tp`).

One subprocess (ep_worker.py, 8 simulated CPU devices) builds each layout and reports tokens,
logits, compilation counts and shardings; the tests assert on that.
"""

from __future__ import annotations

import numpy as np
import pytest
from mesh_cases import QUICK_COMPILE, run_worker

BASELINE = "deepseek_v3:1x1x1"
LAYOUTS = ["deepseek_v3:1x1x2", "deepseek_v3:1x2x2"]  # FAMILY:DPxEPxTP
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def report() -> dict:
    # QUICK_COMPILE: the layouts and their one-device baseline compiled alike, in the same worker
    return run_worker("ep_worker.py", BASELINE, *LAYOUTS, timeout=1500, xla_flags=QUICK_COMPILE)


@pytest.mark.parametrize("case", LAYOUTS)
def test_same_greedy_tokens_and_logits_as_one_device(report, case):
    assert report[case]["tokens"] == report[BASELINE]["tokens"]
    for step in ("prefill_logits", "decode_logits"):
        np.testing.assert_allclose(report[case][step][0], report[BASELINE][step][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", [BASELINE, *LAYOUTS])
def test_no_compilation_after_warm_up(report, case):
    r = report[case]
    assert r["compilations_after_serving"] == r["compilations_after_warm_up"]
    assert r["xla_compilations_while_serving"] == 0


@pytest.mark.parametrize("case", LAYOUTS)
def test_heads_split_over_tp_and_experts_over_ep(report, case):
    _, ep, tp = map(int, case.split(":")[1].split("x"))
    arrays = report[case]["shardings"][0]
    q, kv_b = arrays["layers/q_b_proj/kernel"], arrays["layers/kv_b_proj/weight"]
    assert q["shard_shapes"] == [[q["shape"][0], q["shape"][1], q["shape"][2] // tp]]
    assert kv_b["shard_shapes"] == [[kv_b["shape"][0], kv_b["shape"][1], kv_b["shape"][2] // tp]]
    assert arrays["layers/kv_a_proj/kernel"]["spec"] == "()"  # the latent's projection: replicated
    assert arrays["cache/k"]["spec"] == arrays["cache/v"]["spec"] == "()"  # and the latent cache
    gate = arrays["layers/expert_gate/kernel"]
    layers, experts, hidden, ffw = gate["shape"]
    assert gate["shard_shapes"] == [[layers, experts // ep, hidden, ffw // tp]]
    shared = arrays["layers/shared_gate_proj/kernel"]
    assert shared["shard_shapes"] == [[shared["shape"][0], hidden, shared["shape"][2] // tp]]
