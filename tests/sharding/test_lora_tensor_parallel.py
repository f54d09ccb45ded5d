"""LoRA under tensor parallelism (4 simulated CPU devices, lora_tp_worker.py): the adapters' A and
B split like their base projections (B over the outputs of q/k/v/gate/up, A over the inputs of
o/down), k/v updates repeated where kv heads are, and every adapter's greedy tokens in one mixed
batch still equal transformers + PEFT's, with nothing compiled after warm-up."""

from __future__ import annotations

import pytest
from mesh_cases import run_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # a tp=4 warm-up; test_lora_engine.py covers CI


def test_adapters_split_like_their_projections_give_peft_tokens():
    report = run_worker("lora_tp_worker.py", devices=4, timeout=1100)
    assert report["tokens"] == report["expected"]
    assert report["new_compilations"] == 0
    assert report["kv_replicas"] == 2
    specs = report["specs"]
    assert "'tp'" in specs["q_proj/b"] and "'tp'" not in specs["q_proj/a"]
    assert "'tp'" in specs["k_proj/b"]
    assert "'tp'" in specs["o_proj/a"] and "'tp'" not in specs["o_proj/b"]
    assert "'tp'" in specs["down_proj/a"]
