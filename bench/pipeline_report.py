"""Pipeline stages on a (simulated) mesh: throughput by concurrency, and the schedule's bubble.

    python3 -m bench.pipeline_report [--model smollm2-135m-instruct] [--pp 1 2 4] [--concurrency 1 8 32]

For each pipeline size it builds an engine on the first pp devices (on a CPU-only machine the CPU
is split into max(pp) devices: the stages then share its cores, so these are not speed-ups; they
show what the schedule costs), warms it up, and for each concurrency c generates `--max-tokens`
greedy tokens for c prompts at once, and prints output tokens/s. Then the bubble: the pipelined
layers report which micro-batch each stage ran at each tick (`PipelineLayers`); for the decode
step of each concurrency's batch bucket (M = min(pp, rows) micro-batches) it prints the measured
fraction of idle stage-ticks next to the ideal (P - 1) / (M + P - 1). Those schedules are read with
the tiny random model on the same mesh (the schedule does not depend on the model's size).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def engine_config(pp: int, concurrency: list[int], prompt_tokens: int, max_tokens: int):
    from jaxserve.config import EngineConfig

    tokens = max(256, prompt_tokens * 4)
    return EngineConfig(
        pipeline_parallel_size=pp,
        max_num_seqs=max(concurrency),
        block_size=16,
        decode_batch_buckets=tuple(concurrency),
        max_num_batched_tokens=tokens,
        prefill_token_buckets=(tokens,),
        max_model_len=512,
        num_blocks=16 * max(concurrency) + 16,
        dtype="float32",
    )


def throughput(engine, concurrency: int, prompt_tokens: int, max_tokens: int) -> float:
    """Output tokens/s of `concurrency` greedy requests served together."""
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(concurrency)
    t0 = time.perf_counter()
    for i in range(concurrency):
        engine.add_request(f"c{concurrency}-{i}", rng.integers(3, 1000, prompt_tokens).tolist(), params)
    generated = 0
    while engine.has_unfinished_requests():
        generated += sum(len(d.token_ids) for d in engine.step())
    return generated / (time.perf_counter() - t0)


def decode_schedule(runner, rows: int) -> np.ndarray:
    """[P, ticks]: the micro-batch each stage ran per tick in the runner's decode step of `rows` rows."""
    from jaxserve.runner.host_pack import HostPack

    program = runner.inputs.decode([], rows, runner.engine_config.block_table_buckets[-1])

    def ticks(params, cache, inputs):
        tokens, positions, meta, logits_indices, _ = inputs.unpack()
        _, state = runner.model.apply(
            {"params": params}, tokens, positions, cache, meta, logits_indices, mutable=["intermediates"]
        )
        return state["intermediates"]["pipeline_ticks"][0]

    return np.asarray(jax.jit(ticks)(runner.params, runner.cache, HostPack.of(program.host_args)))


def main(argv: list[str] | None = None) -> None:
    from checkpoints.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", max(args.pp))  # CPU only; accelerators are what they are

    from checkpoints.tiny_random import build_tiny_random
    from jaxserve.engine import LLMEngine

    concurrency = sorted(args.concurrency)
    print(
        f"{args.model}: {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens each; "
        f"devices: {len(jax.devices())} x {jax.devices()[0].platform}"
    )
    rows = []
    for pp in args.pp:
        config = engine_config(pp, concurrency, args.prompt_tokens, args.max_tokens)
        engine = LLMEngine(args.model, config)
        warm = engine.warm_up()
        compiled = engine.num_compilations
        speeds = [throughput(engine, c, args.prompt_tokens, args.max_tokens) for c in concurrency]
        rows.append((pp, warm, speeds))
        print(
            f"pp={pp}: warm-up {warm:.1f} s ({compiled} programs), {engine.num_compilations - compiled} compiled "
            "while serving; output tok/s " + ", ".join(f"c={c}: {s:.1f}" for c, s in zip(concurrency, speeds)),
            flush=True,
        )
    print("\n| pp | " + " | ".join(f"c={c} tok/s" for c in concurrency) + " |")
    print("|---|" + "---|" * len(concurrency))
    for pp, _, speeds in rows:
        print(f"| {pp} | " + " | ".join(f"{s:.1f}" for s in speeds) + " |")

    print("\n| pp | decode rows | micro-batches M | measured bubble | ideal (P-1)/(M+P-1) |")
    print("|---|---|---|---|---|")
    tiny = build_tiny_random(num_layers=max(args.pp))
    for pp in (p for p in args.pp if p > 1):
        engine = LLMEngine(tiny, engine_config(pp, concurrency, args.prompt_tokens, args.max_tokens))
        for c in concurrency:
            schedule = decode_schedule(engine.runner, c)
            micro = int(schedule.max()) + 1
            measured = float(np.mean(schedule < 0))
            print(f"| {pp} | {c} | {micro} | {measured:.3f} | {(pp - 1) / (micro + pp - 1):.3f} |")


if __name__ == "__main__":
    main()
