"""Two CPU processes form one tp=2 engine (gloo collectives): process 0 schedules and mirrors
each bucketed step and block move, process 1 replays it; the tokens equal a one-device engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from child_process import free_port
from mesh_cases import HERE, PROMPTS, TINY_ENGINE, generate_greedy

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from sharding import multihost


def run_two_processes(timeout: float = 600) -> list[dict]:
    base = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "JAX_NUM_PROCESSES": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "multihost_worker.py")],
            cwd=HERE,
            env={**base, "JAX_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-6000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_two_process_tensor_parallel_matches_one_device():
    leader, follower = run_two_processes()
    one_device = LLMEngine(build_tiny_random(num_heads=8, num_kv_heads=4), EngineConfig(**TINY_ENGINE))
    assert leader["tokens"] == generate_greedy(one_device, PROMPTS)  # a roomy pool: no preemption
    # Preemption swapped blocks out to each process's host memory and back in.
    assert leader["preemptions"] >= 1
    assert leader["mirrored"].get("DEVICE_TO_HOST", 0) >= 1 and leader["mirrored"].get("HOST_TO_DEVICE", 0) >= 1
    # Each process holds one half of the kv heads of the cache.
    for r in (leader, follower):
        assert r["cache_spec"] == "(None, 'tp')"
        assert r["cache_local_shards"] == [[r["cache_shape"][0], r["cache_shape"][1] // 2, *r["cache_shape"][2:]]]
        # a decode and a prefill step, the sampler (8 rows), the penalty-row reset, the prompt
        # scorer, the pooling program: all at warm-up
        assert r["compilations_after_warm_up_and_serving"] == 6
    assert follower["replayed"] >= 1 + 7  # a prefill (or more) and a decode per new token


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    assert multihost.initialize() is False
    assert multihost.initialize(num_processes=1) is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_processes=2, process_id=0), "coordinator address"),
        (dict(num_processes=2, coordinator_address="127.0.0.1:1"), "process id"),
        (dict(num_processes=2, coordinator_address="127.0.0.1:1", process_id=2), "not in"),
    ],
)
def test_initialize_names_what_is_missing(monkeypatch, kwargs, message):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        multihost.initialize(**kwargs)
