"""Run by test_tensor_data_parallel.py in a subprocess with 8 simulated CPU devices.

For each mesh layout (dp x tp) of the tiny model it builds the engine (a data-parallel engine for dp > 1),
warms it up, computes the prefill and decode logits of the runner's own bucketed steps,
generates greedily, and reports everything as one JSON line: tokens, logits, compilation
counts, the shardings read back from the parameter and cache arrays, and the collectives of
the compiled steps. The test process makes the assertions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile

import jax
import numpy as np
from jax._src.dispatch import BACKEND_COMPILE_EVENT
from mesh_cases import CACHE_ENV, PROMPTS, TINY_ENGINE, generate_greedy

from checkpoints import registry
from checkpoints.orbax_io import load_orbax, save_orbax
from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine, make_engine
from jaxserve.request import Request
from jaxserve.runner import enable_persistent_compilation_cache
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.output import ScheduledChunk
from sharding import hlo

WIDTH = TINY_ENGINE["block_table_buckets"][0]


@contextlib.contextmanager
def count_xla_compilations():
    """Yields a list that gets one entry per executable built inside the block: any, not only
    the runner's own (the event wraps XLA compilation and persistent-cache reads alike)."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def step_logits(runner, prompts: list[list[int]]) -> tuple[list, list]:
    """Logits of one ragged prefill step over `prompts`, then of one decode step for each."""
    requests = [Request(f"logits{i}", list(p), SamplingParams(), seed=0) for i, p in enumerate(prompts)]
    tables = [np.arange(1 + WIDTH * i, 1 + WIDTH * (i + 1), dtype=np.int32) for i in range(len(prompts))]
    chunks = [ScheduledChunk(r, 0, r.num_tokens, t, True) for r, t in zip(requests, tables)]
    for r in requests:  # what prepare() does for the requests a step samples
        runner.inputs.batch.join(r)
    program = runner.inputs.prefill(
        chunks, TINY_ENGINE["prefill_token_buckets"][0], TINY_ENGINE["prefill_seq_buckets"][0], WIDTH
    )
    prefill = np.asarray(runner.step_logits(program))[: len(prompts)]
    # The decodes' requests, the prompts and the tokens the prefill gave, join the batch as they are now.
    requests = [
        Request(f"decode{i}", p + [int(row.argmax())], SamplingParams(), seed=0)
        for i, (p, row) in enumerate(zip(prompts, prefill))
    ]
    for r in requests:
        runner.inputs.batch.join(r)
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, t, True) for r, t in zip(requests, tables)]
    program = runner.inputs.decode(chunks, TINY_ENGINE["decode_batch_buckets"][0], WIDTH)
    return prefill.tolist(), np.asarray(runner.step_logits(program))[: len(prompts)].tolist()


def shardings(runner) -> dict:
    """Spec, global shape, shard shapes and devices of every parameter and the cache, from the arrays."""

    def describe(x: jax.Array) -> dict:
        return {
            "spec": str(tuple(x.sharding.spec)),
            "shape": list(x.shape),
            "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards}),
            "devices": sorted(d.id for d in x.sharding.device_set),
        }

    out = {
        jax.tree_util.keystr(path, simple=True, separator="/"): describe(x)
        for path, x in jax.tree_util.tree_leaves_with_path(runner.params)
    }
    out["cache/k"] = describe(runner.cache.k)
    out["cache/v"] = describe(runner.cache.v)
    return out


def collectives(runner, key: tuple) -> list[dict]:
    """Collective ops of a compiled step: kind, result shape, and whether in the layer loop."""
    return [dataclasses.asdict(c) for c in hlo.collectives(runner.executables.compiled[key].as_text())]


def run_layout(
    model,
    dp: int,
    tp: int,
    with_hlo: bool,
    attention_backend: str | None = None,
    num_scheduler_steps: int = 1,
    unroll_layers: bool = False,
) -> dict:
    config = EngineConfig(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        attention_backend=attention_backend,
        num_scheduler_steps=num_scheduler_steps,
        unroll_layers=unroll_layers,
        **TINY_ENGINE,
    )
    engine = make_engine(model, config)
    with count_xla_compilations() as warm_up_compiles:
        engine.warm_up()
    warm = engine.num_compilations
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    logits = [step_logits(e.runner, PROMPTS[:3]) for e in replicas]
    with count_xla_compilations() as serving_compiles:
        tokens = generate_greedy(engine, PROMPTS)
    result = {
        "tokens": tokens,
        "prefill_logits": [p for p, _ in logits],
        "decode_logits": [d for _, d in logits],
        "compilations_after_warm_up": warm,
        "compilations_after_serving": engine.num_compilations,
        "xla_compilations_during_warm_up": len(warm_up_compiles),
        "xla_compilations_while_serving": len(serving_compiles),
        "shardings": [shardings(e.runner) for e in replicas],
        "served_kv_heads": replicas[0].runner.config.num_kv_heads,
        "admissions_per_replica": [e.kv.stats.queries for e in replicas],
    }
    if with_hlo:
        runner = replicas[0].runner
        result["collectives"] = {
            "decode": collectives(runner, ("decode", TINY_ENGINE["decode_batch_buckets"][0], WIDTH)),
            "prefill": collectives(
                runner,
                ("prefill", TINY_ENGINE["prefill_token_buckets"][0], TINY_ENGINE["prefill_seq_buckets"][0], WIDTH),
            ),
            "sample": collectives(runner, ("sample", TINY_ENGINE["decode_batch_buckets"][0])),
        }
    return result


def restore_into_shards(model, tp: int) -> dict:
    """Save `model` as an orbax checkpoint and serve it by path: the engine restores it straight
    into the rules' shardings for its 1 x tp mesh. What the restore returned is read back by
    watching the registry's call to `load_orbax`."""
    restored = []

    def watched_load_orbax(*args, **kwargs):
        restored.append(load_orbax(*args, **kwargs))
        return restored[-1]

    registry.load_orbax = watched_load_orbax
    try:
        with tempfile.TemporaryDirectory() as tmp:
            save_orbax(model, f"{tmp}/ckpt")
            layout = run_layout(f"{tmp}/ckpt", 1, tp, with_hlo=False)
    finally:
        registry.load_orbax = load_orbax
    (loaded,) = restored
    restored_specs = {
        jax.tree_util.keystr(p, simple=True, separator="/"): str(tuple(x.sharding.spec))
        for p, x in jax.tree_util.tree_leaves_with_path(loaded.params)
    }
    return {**layout, "restored_specs": restored_specs}


def main(cases: list[str]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    if os.environ.get(CACHE_ENV):  # replicas of one layout compile the same programs
        enable_persistent_compilation_cache(os.environ[CACHE_ENV])
    models = {
        "gqa": build_tiny_random(num_heads=8, num_kv_heads=4),  # 2 query heads per kv head
        "few_kv": build_tiny_random(num_heads=8, num_kv_heads=2, tie_word_embeddings=True),
    }
    results = {}
    # "MODEL:DPxTP", "MODEL+pallas:DPxTP" (Pallas attention), "MODEL+restored:1xTP",
    # "MODEL+multistep:DPxTP" (multi-step decode, 4 steps per loop), "MODEL+unrolled:DPxTP"
    # (layers unrolled over per-layer weights)
    for case in cases:
        name, layout = case.split(":")
        model, _, variant = name.partition("+")
        dp, tp = map(int, layout.split("x"))
        if variant == "restored":
            results[case] = restore_into_shards(models[model], tp)
        elif variant == "multistep":
            results[case] = run_layout(models[model], dp, tp, with_hlo=False, num_scheduler_steps=4)
        elif variant == "unrolled":
            results[case] = run_layout(models[model], dp, tp, with_hlo=False, unroll_layers=True)
        else:
            results[case] = run_layout(
                models[model], dp, tp, with_hlo=tp > 1 and dp == 1, attention_backend=variant or None
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
