"""Run by test_expert_parallel.py in a subprocess with 8 simulated CPU devices.

For each layout (dp x ep x tp) of a tiny MoE model (`FAMILY:DPxEPxTP`) it builds the engine (a
data-parallel engine for dp > 1), warms it up, computes the prefill and decode logits of the runner's own
bucketed steps, generates greedily, and reports one JSON line: tokens, logits, compilation
counts, the shardings read back from the parameter arrays and each step's expert load. The test
process makes the assertions.
"""

from __future__ import annotations

import json
import os
import sys

import jax
from mesh_cases import CACHE_ENV, PROMPTS, TINY_ENGINE, generate_greedy
from tp_worker import count_xla_compilations, shardings, step_logits

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine, make_engine
from jaxserve.runner import enable_persistent_compilation_cache


def run_layout(model, dp: int, ep: int, tp: int) -> dict:
    config = EngineConfig(tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=ep, **TINY_ENGINE)
    engine = make_engine(model, config)
    engine.warm_up()
    warm = engine.num_compilations
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    logits = [step_logits(e.runner, PROMPTS[:3]) for e in replicas]
    with count_xla_compilations() as serving_compiles:
        tokens = generate_greedy(engine, PROMPTS)
    return {
        "tokens": tokens,
        "prefill_logits": [p for p, _ in logits],
        "decode_logits": [d for _, d in logits],
        "compilations_after_warm_up": warm,
        "compilations_after_serving": engine.num_compilations,
        "xla_compilations_while_serving": len(serving_compiles),
        "shardings": [shardings(e.runner) for e in replicas],
        "mesh": [dict(e.runner.mesh.shape) for e in replicas],
    }


def main(cases: list[str]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    if os.environ.get(CACHE_ENV):  # the replicas of a dp layout compile the same programs
        enable_persistent_compilation_cache(os.environ[CACHE_ENV])
    results = {}
    for case in cases:  # "FAMILY:DPxEPxTP"
        family, layout = case.split(":")
        dp, ep, tp = map(int, layout.split("x"))
        results[case] = run_layout(build_tiny_random(family=family), dp, ep, tp)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
