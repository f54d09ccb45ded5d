"""One process of a two-process tensor-parallel engine (run by test_multihost.py).

Started twice with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES=2 / JAX_PROCESS_ID and one
simulated CPU device each: the tiny model is split tp=2 across the two processes. Process 0
runs the engine (scheduler, KV manager) and mirrors every device operation; process 1 replays
them. The KV pool is small and preemption swaps to the host, so block moves to and from each
process's host memory are mirrored too. Each prints one JSON line.
"""

from __future__ import annotations

import json

from sharding import multihost

assert multihost.initialize(), "expected a multi-process job from the environment"

import jax  # noqa: E402
from mesh_cases import PROMPTS, SWAP_ENGINE, generate_greedy  # noqa: E402

from checkpoints.tiny_random import build_tiny_random  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine import LLMEngine  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402


def main() -> None:
    assert jax.process_count() == 2 and len(jax.devices()) == 2 and len(jax.local_devices()) == 1
    mesh = make_mesh(tensor_parallel_size=2)  # one device from each process
    engine = LLMEngine(
        build_tiny_random(num_heads=8, num_kv_heads=4), EngineConfig(tensor_parallel_size=2, **SWAP_ENGINE), mesh
    )
    engine.warm_up()  # every process compiles and runs the same warm-up steps
    multihost.barrier("worker-warm")
    channel = multihost.StepChannel(jax.devices())
    cache = engine.runner.cache.k
    report = {
        "process": jax.process_index(),
        "cache_spec": str(tuple(cache.sharding.spec)),
        "cache_local_shards": [list(s.data.shape) for s in cache.addressable_shards],
        "cache_shape": list(cache.shape),
    }
    if jax.process_index() == 0:
        leader = multihost.Leader(engine.runner, channel)
        mirrored = []

        def mirror(op: tuple) -> None:
            mirrored.append(op[1].name if op[0] == "move" else op[0])
            leader.send(op)

        engine.runner.mirror = mirror
        report["tokens"] = generate_greedy(engine, PROMPTS)
        report["mirrored"] = {kind: mirrored.count(kind) for kind in set(mirrored)}
        report["preemptions"] = engine.scheduler.num_preemptions
        leader.stop()
    else:
        report["replayed"] = multihost.follow(engine.runner, channel)
    report["compilations_after_warm_up_and_serving"] = engine.num_compilations
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
