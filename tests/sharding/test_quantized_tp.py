"""Quantized weights under tensor parallelism: int8 codes and their per-channel scales shard like
their base kernels (q_proj column-parallel: codes and scales split on the output features; o_proj
row-parallel: codes split on the input features, the single group of scales replicated; the
output head split over the vocabulary), and tp=2
gives the tokens of tp=1 (8 simulated CPU devices, in a subprocess)."""

import pytest
from mesh_cases import run_worker


@pytest.mark.slow  # ~50 s; test_rules.py's quantized case covers the shardings in CI
def test_int8_tp2_gives_the_tokens_of_tp1_with_arrays_sharded_like_their_kernels():
    out = run_worker("quant_tp_worker.py")
    assert out["tp2"]["tokens"] == out["tp1"]["tokens"]
    assert all(len(t) == 8 for t in out["tp1"]["tokens"])
    assert out["tp2"]["dtypes"] == {"q_proj": "int8", "down_proj": "int8"}
    specs = out["tp2"]["specs"]
    assert specs["q_proj/kernel"] == specs["q_proj/kernel_scale"] == [None, None, "tp"]
    assert specs["o_proj/kernel"] == [None, "tp", None]
    assert specs["o_proj/kernel_scale"] == []  # replicated
    # the int8 output head [E, V] and its groups of scales: vocab-parallel, like the float head
    assert out["tp2"]["head_specs"] == {"kernel": [None, "tp"], "kernel_scale": [None, "tp"]}
