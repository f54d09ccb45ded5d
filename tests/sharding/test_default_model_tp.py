"""The default model (SmolLM2-135M: 9 query heads, 3 kv heads) under tensor parallelism."""

from __future__ import annotations

import pytest
from mesh_cases import QUICK_COMPILE, run_worker

from checkpoints.registry import DEFAULT_MODEL
from sharding.mesh import plan_tensor_parallel


def test_tp_must_divide_the_query_heads():
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 does not divide the model's 9 query heads; "
        r"use one of \[1, 3, 9\]",
    ):
        plan_tensor_parallel(num_heads=9, num_kv_heads=3, tp=2)
    assert plan_tensor_parallel(9, 3, 3).served_kv_heads == 3
    assert plan_tensor_parallel(9, 3, 9).kv_replicas == 3


@pytest.mark.integration
def test_default_model_refuses_tp2_with_a_clear_error():
    from jaxserve import LLM

    with pytest.raises(ValueError, match="does not divide the model's 9 query heads"):
        LLM(DEFAULT_MODEL, tensor_parallel_size=2, warm_up=False)


@pytest.mark.integration
def test_default_model_tp3_equals_one_device():
    # QUICK_COMPILE: tp=1 and tp=3 compiled alike, in the same worker
    r = run_worker("default_model_worker.py", devices=3, xla_flags=QUICK_COMPILE)
    assert r["tokens"]["3"] == r["tokens"]["1"] and len(r["tokens"]["1"]) == 8
    # f32 sums in another order: within 1e-5 of the logits' scale.
    assert r["max_abs_logit_diff"] <= 1e-5 * r["max_abs_logit"]
    # warm-up: a decode and a prefill step, the sampler (8 rows), the penalty-row reset, the prompt
    # scorer and the pooling program of the prefill bucket; then nothing
    assert r["compilations"] == {"1": [6, 6], "3": [6, 6]}
    params, cache = r["param_bytes_per_device"], r["cache_bytes_per_device"]
    assert len(params["3"]) == len(cache["3"]) == 3
    # Everything but the (replicated) norm scales is split three ways; the cache exactly.
    assert all(abs(b - params["1"]["0"] / 3) < 0.001 * params["1"]["0"] for b in params["3"].values())
    assert all(b * 3 == cache["1"]["0"] for b in cache["3"].values())
    assert r["cache_shard_shape"]["3"][1] == 1
