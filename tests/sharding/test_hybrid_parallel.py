"""Gated DeltaNet hybrids (tiny random Qwen3.5 and Qwen3-Next) over simulated devices equal one
device: tensor parallelism (the Gated DeltaNet split by heads, its states with them; the gated
full attention by heads as other attention), and for Qwen3-Next expert parallelism with it.

One subprocess (hybrid_tp_worker.py, 8 simulated CPU devices) runs every layout. The tiny models'
tokens are compared with transformers' (tests/data/family_reference.json, which one device gives:
test_hybrid_engine.py, test_model_families.py); the tiny Qwen3.5 with 4 key heads, which 4 devices
split, has no reference and is compared with its own run on one device. Every run includes a
prompt longer than a prefill step and a prefix hit that restores a state snapshot.
"""

from __future__ import annotations

import pytest
from mesh_cases import QUICK_COMPILE, run_worker

WIDE_BASELINE = "qwen3_5:1x1:wide"
LAYOUTS = ["qwen3_5:1x2", "qwen3_next:2x2", "qwen3_5:1x4:wide"]  # FAMILY:EPxTP[:wide]
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def report() -> dict:
    return run_worker("hybrid_tp_worker.py", *LAYOUTS, WIDE_BASELINE, timeout=1100, xla_flags=QUICK_COMPILE)


@pytest.mark.parametrize("case", LAYOUTS)
def test_same_greedy_tokens_as_one_device_also_after_a_prefix_hit(report, case):
    r = report[case]
    expected = r["reference"] or report[WIDE_BASELINE]["tokens"]
    assert r["tokens"] == expected
    assert r["hit_cached"] == 96  # the 100-token prompt's 12 full blocks, its state restored from their snapshot
    assert r["hit_tokens"] == expected[3]


@pytest.mark.parametrize("case", [*LAYOUTS, WIDE_BASELINE])
def test_no_compilation_after_warm_up_and_everything_free_after(report, case):
    r = report[case]
    assert r["compilations_after_serving"] == r["compilations_after_warm_up"]
    assert r["xla_compilations_while_serving"] == 0
    a = r["accounting"]
    assert not a["unfinished"] and a["used"] == 0 and a["free_or_cached"] == a["num_blocks"]
    assert a["slots_free_or_kept"] == a["num_slots"] - 1  # slot 0 is reserved


@pytest.mark.parametrize("case", LAYOUTS)
def test_projections_and_states_split_by_heads(report, case):
    r = report[case]
    ep, tp = map(int, case.split(":")[1].split("x"))
    assert r["mesh"]["tp"] == tp and r["mesh"]["ep"] == ep
    for name, (shape, shard) in r["arrays"].items():
        axis = {"state/conv": 3, "state/recurrent": 2, "linear_layers/out_proj/kernel": 1}.get(name, 2)
        assert shard == [d // tp if i == axis else d for i, d in enumerate(shape)], name


@pytest.mark.parametrize("case", LAYOUTS)
@pytest.mark.parametrize("step, rows", [("decode", 4), ("prefill", 64)])
def test_each_layer_communicates_only_to_complete_its_row_parallel_projections(report, case, step, rows):
    """Each device computes its heads' projections, conv, delta rule and gated norm on its own: in the layer
    loop only the all-reduces of the row-parallel outputs [rows, E] (out_proj of the 3 Gated DeltaNet
    layers, o_proj of the full-attention one, the MLPs'), no all-gather of a head's pieces."""
    in_loop = [c for c in report[case]["collectives"][step] if c["in_layer_loop"]]
    assert {(c["op"], c["shape"].split("{")[0]) for c in in_loop} == {("all-reduce", f"f32[{rows},64]")}
    modules = [c["op_name"].rsplit("/", 2)[-2] for c in in_loop]
    assert (modules.count("out_proj"), modules.count("o_proj")) == (3, 1)
