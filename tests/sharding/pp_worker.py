"""Run by test_pipeline_parallel.py in a subprocess with 8 simulated CPU devices.

Each case is `MODEL[+VARIANT...]:DPxPPxTP`. MODEL: `tiny` (4 layers, so that pp=3 gives uneven
stages) or `default` (SmolLM2-135M, 30 layers). VARIANT `serving`: preemption with swap to the host
(too few blocks) and a second round of the prompts (prefix-cache hits), with async scheduling (the
default); `multistep` adds multi-step decode (2 steps per program); `reference` only generates (no
warm-up, no report beyond the tokens: the one-device result the others are compared with). For
each other case the worker builds the engine (a data-parallel engine for dp > 1), warms it up, generates greedily
and with seeded sampling, checks that every KV pool is free afterwards, and reads the schedule that
the pipelined layers report for a decode and a prefill step (which micro-batch each stage ran at
each tick), and the engine's bubble counters (snapshot and Prometheus text) against the model
steps it read. VARIANT `handoff`: a prefill engine of PP stages hands a prompt's KV blocks to a decode
engine on one device. It prints one JSON line; the test asserts on it.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from mesh_cases import PROMPTS, SWAP_ENGINE, TINY_ENGINE, generate_greedy
from tp_worker import count_xla_compilations

from checkpoints.registry import DEFAULT_MODEL, load_model
from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine, make_engine
from jaxserve.kv_tiers import kv_fingerprint
from jaxserve.request import Request
from jaxserve.runner.host_pack import HostPack
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.output import ScheduledChunk
from server.metrics import ServerMetrics

WIDTH = TINY_ENGINE["block_table_buckets"][0]


def generate_seeded(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Sampled tokens (temperature 0.9, top-p 0.95, a seed per request)."""
    ids = [f"s{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(
            rid, prompt, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
        )
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out[d.request_id].extend(d.token_ids)
    return [out[rid] for rid in ids]


def kv_leaks(engine) -> list[str]:
    """What is left held in each replica's KV pool (empty: all free or reclaimable)."""
    leaks = []
    for replica in engine.replicas if isinstance(engine, DataParallelEngine) else [engine]:
        kv = replica.kv
        kv.check_integrity()
        usage = kv.usage()
        if (
            kv.num_live_handles
            or usage.used
            or usage.pinned
            or usage.host_swapped
            or usage.free + usage.cached_idle != usage.num_blocks
        ):
            leaks.append(str(usage))
    return leaks


def schedule_of(runner, program) -> list[list[int]]:
    """[P, ticks]: the micro-batch each stage ran per tick (-1: idle), as the pipelined layers
    report it for `program` (run on a copy of the runner's cache: its own is left as it is)."""

    def ticks(params, cache, inputs):
        tokens, positions, meta, logits_indices, _ = inputs.unpack()
        _, state = runner.model.apply(
            {"params": params}, tokens, positions, cache, meta, logits_indices, mutable=["intermediates"]
        )
        return state["intermediates"]["pipeline_ticks"][0]

    return np.asarray(jax.jit(ticks)(runner.params, runner.cache, HostPack.of(program.host_args))).tolist()


def count_fetched_steps(runner) -> list[int]:
    """A one-item list counting the programs of the iterations `runner` reads from now on."""
    counted = [0]
    fetch = runner.fetch

    def counting(handle):
        counted[0] += len(handle.parts)
        return fetch(handle)

    runner.fetch = counting
    return counted


def pipeline_counters(engine, fetched: int) -> dict:
    """The engine's bubble counters, as its snapshot and /metrics show them, and the model steps
    it read (`fetched`)."""
    snapshot = engine.snapshot()
    text = ServerMetrics().render(snapshot, True).decode()
    return {
        "busy": list(snapshot.pipeline_stage_busy_ticks),
        "ticks": snapshot.pipeline_ticks,
        "bubble_fraction": snapshot.pipeline_bubble_fraction,
        "model_steps": fetched,
        "metrics": [line for line in text.splitlines() if line.startswith("jaxserve_pipeline")],
    }


def schedules(runner) -> dict:
    """The schedules of a full decode step (the bucket's rows) and of a prefill step of 3 prompts."""
    requests = [Request(f"sched{i}", list(p), SamplingParams(), seed=0) for i, p in enumerate(PROMPTS[:3])]
    tables = [np.arange(1 + WIDTH * i, 1 + WIDTH * (i + 1), dtype=np.int32) for i in range(3)]
    for r in requests:
        runner.inputs.batch.join(r)
    chunks = [ScheduledChunk(r, 0, r.num_tokens, t, True) for r, t in zip(requests, tables)]
    prefill = runner.inputs.prefill(
        chunks, TINY_ENGINE["prefill_token_buckets"][0], TINY_ENGINE["prefill_seq_buckets"][0], WIDTH
    )
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, t, True) for r, t in zip(requests, tables)]
    decode = runner.inputs.decode(chunks, TINY_ENGINE["decode_batch_buckets"][0], WIDTH)
    result = {"prefill": schedule_of(runner, prefill), "decode": schedule_of(runner, decode)}
    runner.inputs.batch.release_finished()  # these requests never ran: their batch rows go back
    return result


def run_reference(model, prompts: list[list[int]], dp: int, pp: int, tp: int) -> dict:
    """The tokens alone, compiled as the steps come (no warm-up: nothing else is checked)."""
    config = EngineConfig(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, **TINY_ENGINE)
    engine = make_engine(model, config)
    return {"greedy": generate_greedy(engine, prompts), "seeded": generate_seeded(engine, prompts)}


def run_case(model, prompts: list[list[int]], dp: int, pp: int, tp: int, serving: bool, multistep: bool) -> dict:
    settings = {**(SWAP_ENGINE if serving else TINY_ENGINE), "num_scheduler_steps": 2 if multistep else 1}
    config = EngineConfig(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, **settings)
    engine = make_engine(model, config)
    with count_xla_compilations() as warm_up_compiles:
        engine.warm_up()
    warm = engine.num_compilations
    replicas = engine.replicas if isinstance(engine, DataParallelEngine) else [engine]
    fetched = [count_fetched_steps(r.runner) for r in replicas]
    with count_xla_compilations() as serving_compiles:
        greedy = generate_greedy(engine, prompts)
        again = generate_greedy(engine, prompts, prefix="again") if serving else greedy
        seeded = generate_seeded(engine, prompts)
    runner = replicas[0].runner
    return {
        "greedy": greedy,
        "again": again,
        "seeded": seeded,
        "compilations": [warm, engine.num_compilations],
        "xla_compilations_while_serving": len(serving_compiles),
        "xla_compilations_during_warm_up": len(warm_up_compiles),
        "kv_leaks": kv_leaks(engine),
        "preemptions": sum(r.scheduler.num_preemptions for r in replicas) if serving else None,
        "cache_spec": str(tuple(runner.cache.k.sharding.spec)),
        "cache_shard_shape": list(runner.cache.k.addressable_shards[0].data.shape),
        "layer_devices": sorted({s.device.id for s in runner.params["layers"]["q_proj"]["kernel"].addressable_shards}),
        "schedules": schedules(runner) if pp > 1 else None,
        "pipeline_counters": pipeline_counters(engine, sum(n for (n,) in fetched)),
    }


def run_handoff(model, source_pp: int) -> dict:
    """A prefill engine with `source_pp` stages hands a prompt's full blocks, as host bytes, to a
    decode engine on one device, and back (the disaggregated path's engine side,
    `jaxserve.kv_transfer`); both key the blocks alike (`kv_fingerprint(model_layers=True)`)."""

    def engine(pp: int):
        return make_engine(model, EngineConfig(pipeline_parallel_size=pp, **TINY_ENGINE))

    staged, single = engine(source_pp), engine(1)
    prompt = PROMPTS[3]  # 70 tokens: 8 full blocks of 8
    report = {
        "handoff_keys_match": kv_fingerprint(staged.runner, "m", model_layers=True)
        == kv_fingerprint(single.runner, "m", model_layers=True),
        "disk_keys_match": kv_fingerprint(staged.runner, "m") == kv_fingerprint(single.runner, "m"),
        "kv_leaks": [],
    }
    for direction, (source, dest) in {"to_one": (staged, single), "from_one": (engine(1), engine(source_pp))}.items():
        want = generate_greedy(source, [prompt], prefix=f"src-{direction}")[0]
        held = source.hold_prefix(prompt)
        k, v = source.read_kv_blocks(held, 0, held.num_blocks)
        longer = dest.write_kv_blocks(dest.hold_prefix(prompt), prompt, k, v)
        got_k, got_v = dest.read_kv_blocks(longer, 0, longer.num_blocks)
        source.release_hold(held)
        dest.release_hold(longer)
        computed = dest.stats.prompt_tokens_computed
        tokens = generate_greedy(dest, [prompt], prefix=f"dst-{direction}")[0]
        report[direction] = {
            "handed_blocks": held.num_blocks,
            "written_blocks": longer.num_blocks,
            "layers": k.shape[0],
            "same_bytes": bool(np.array_equal(got_k, k) and np.array_equal(got_v, v)),
            "source_tokens": want,
            "dest_tokens": tokens,
            "dest_prompt_tokens_computed": dest.stats.prompt_tokens_computed - computed,
        }
        report["kv_leaks"] += kv_leaks(source) + kv_leaks(dest)
    return report


def main(cases: list[str]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    models, prompts = {}, {}
    results = {}
    for case in cases:
        name, layout = case.split(":")
        model, *variants = name.split("+")
        if model not in models:
            if model == "tiny":
                models[model], prompts[model] = build_tiny_random(num_layers=4), PROMPTS
            else:
                models[model] = loaded = load_model(DEFAULT_MODEL)
                tokenizer = loaded.tokenizer_bundle.tokenizer
                prompts[model] = [
                    tokenizer.encode(t).ids
                    for t in (
                        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                        "The three primary colours are",
                        "def fibonacci(n):",
                    )
                ]
        dp, pp, tp = map(int, layout.split("x"))
        if "handoff" in variants:
            results[case] = run_handoff(models[model], pp)
        elif "reference" in variants:
            results[case] = run_reference(models[model], prompts[model], dp, pp, tp)
        else:
            results[case] = run_case(
                models[model], prompts[model], dp, pp, tp, "serving" in variants, "multistep" in variants
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
