"""Mixture-of-experts engines with their experts split over 2 and 4 simulated devices (expert
parallelism), composed with tensor and data parallelism, equal one device.

One subprocess (ep_worker.py) builds every layout of the tiny Mixtral (4 experts, top-2,
renormalised), Qwen3-MoE (8 experts, top-2, not renormalised) and gpt-oss (4 experts with biases,
gate and up interleaved; attention sinks split with the heads over tp; its experts also as MXFP4
blocks and scales, split over ep) models and reports tokens,
logits, compilation counts and the shardings read from the arrays; the tests assert on that.
"""

from __future__ import annotations

import numpy as np
import pytest
from mesh_cases import CACHE_ENV, QUICK_COMPILE, run_worker

BASELINES = ["mixtral:1x1x1", "qwen3_moe:1x1x1", "gpt_oss:1x1x1", "gpt_oss_mxfp4:1x1x1"]
# FAMILY:DPxEPxTP. Each layout costs a warm-up (~13 s of CI): ep 4 and 2 alone (Mixtral, gpt-oss's MXFP4
# experts), ep x tp (Qwen3-MoE; gpt-oss, whose sinks split with the heads over tp), dp x ep. Each family
# runs each kind of split once.
LAYOUTS = [
    "mixtral:1x4x1",
    "qwen3_moe:1x2x2",
    "qwen3_moe:2x2x1",
    "gpt_oss:1x2x2",
    "gpt_oss_mxfp4:1x2x1",
]
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    # QUICK_COMPILE: every layout and its one-device baseline compiled alike, in the same worker; the
    # persistent cache serves a dp layout's second replica the programs of its first (still counted as
    # compilations by count_xla_compilations, so none while serving stays checked).
    cache = str(tmp_path_factory.mktemp("xla-cache-ep"))
    return run_worker(
        "ep_worker.py", *BASELINES, *LAYOUTS, env={CACHE_ENV: cache}, timeout=1500, xla_flags=QUICK_COMPILE
    )


def baseline(report: dict, case: str) -> dict:
    return report[case.split(":")[0] + ":1x1x1"]


@pytest.mark.parametrize("case", LAYOUTS)
def test_same_greedy_tokens_as_one_device(report, case):
    assert report[case]["tokens"] == baseline(report, case)["tokens"]


@pytest.mark.parametrize("step", ["prefill_logits", "decode_logits"])
@pytest.mark.parametrize("case", LAYOUTS)
def test_logits_within_1e5_of_one_device(report, case, step):
    for replica in report[case][step]:
        np.testing.assert_allclose(replica, baseline(report, case)[step][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", BASELINES + LAYOUTS)
def test_no_compilation_after_warm_up(report, case):
    r = report[case]
    assert r["compilations_after_serving"] == r["compilations_after_warm_up"]
    assert r["xla_compilations_while_serving"] == 0


@pytest.mark.parametrize("case", LAYOUTS)
def test_experts_are_split_over_ep_and_their_hidden_units_over_tp(report, case):
    dp, ep, tp = map(int, case.split(":")[1].split("x"))
    for mesh, arrays in zip(report[case]["mesh"], report[case]["shardings"]):
        assert mesh == {"dp": 1, "pp": 1, "ep": ep, "tp": tp}
        if "layers/expert_gate_up/blocks" in arrays:  # MXFP4 [L, X, out, in / 32, 16]: whole experts over ep
            blocks = arrays["layers/expert_gate_up/blocks"]
            assert blocks["spec"] == str((None, "ep", "tp", None, None)) and tp == 1
            layers, experts, *rest = blocks["shape"]
            assert blocks["shard_shapes"] == [[layers, experts // ep, *rest]]
            continue
        gate = arrays.get("layers/expert_gate/kernel") or arrays["layers/expert_gate_up/kernel"]  # gpt-oss: fused
        down = arrays["layers/expert_down/kernel"]
        layers, experts, hidden, ffw = gate["shape"]
        assert gate["spec"] == str((None, "ep", None, "tp"))
        assert gate["shard_shapes"] == [[layers, experts // ep, hidden, ffw // tp]]
        assert down["shard_shapes"] == [[layers, experts // ep, down["shape"][2] // tp, hidden]]
        assert len(gate["devices"]) == ep * tp
        # The router is replicated; attention is split over tp only (replicated over ep).
        assert arrays["layers/router/kernel"]["spec"] == "()"
        q = arrays["layers/q_proj/kernel"]
        assert q["shard_shapes"] == [[q["shape"][0], q["shape"][1], q["shape"][2] // tp]]
        if "layers/sinks/logits" in arrays:  # gpt-oss: one sink per query head, split with them
            sinks = arrays["layers/sinks/logits"]
            assert sinks["shard_shapes"] == [[sinks["shape"][0], sinks["shape"][1] // tp]]
