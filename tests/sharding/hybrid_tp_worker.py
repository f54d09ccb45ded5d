"""Run by test_hybrid_parallel.py in a subprocess with 8 simulated CPU devices.

For each layout of a tiny Gated DeltaNet hybrid (`FAMILY:EPxTP`, or `FAMILY:EPxTP:wide` for the
model with 4 key heads, which 4 devices split) it builds an LLM, warms it up, generates greedily the
reference prompts (one longer than a prefill step: chunked), then the longest again (a prefix hit
that restores the state snapshot kept at its last full block), and reports one JSON
line: tokens, cached tokens, compilation counts, the KV pool's and state slots' accounting after,
and the shardings of the Gated DeltaNet's arrays. The test process makes the assertions.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
from tp_worker import collectives, count_xla_compilations

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

REFERENCE = pathlib.Path(__file__).parents[1] / "data" / "family_reference.json"
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=48,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
)
WIDE = dict(linear_num_key_heads=4, linear_num_value_heads=8)  # Gated DeltaNet heads 4 devices split
ARRAYS = ("linear_layers/in_proj_qkv/kernel", "linear_layers/in_proj_qkvz/kernel", "linear_layers/out_proj/kernel")


def accounting(engine) -> dict:
    """The KV pool's and the state slots' counts once every request has ended."""
    kv = engine.kv
    kv.check_integrity()
    usage = kv.usage()
    return {
        "unfinished": engine.has_unfinished_requests(),
        "used": usage.used,
        "free_or_cached": usage.free + usage.cached_idle,
        "num_blocks": usage.num_blocks,
        "slots_free_or_kept": kv.state_slots.num_free + kv.snapshots.num_held,
        "num_slots": kv.state_slots.num_slots,
    }


def array_shards(runner) -> dict:
    """Global and per-device shapes of the Gated DeltaNet's projections and states."""
    params, cache = runner.params, runner.state.cache
    arrays = {"state/conv": cache.state.conv, "state/recurrent": cache.state.recurrent}
    for path in ARRAYS:
        group, name, leaf = path.split("/")
        if name in params[group]:
            arrays[path] = params[group][name][leaf]
    return {k: [list(a.shape), list(a.addressable_shards[0].data.shape)] for k, a in arrays.items()}


def run_layout(family: str, ep: int, tp: int, wide: bool) -> dict:
    model = build_tiny_random(family=family, **(WIDE if wide else {}))
    llm = LLM(model, tensor_parallel_size=tp, expert_parallel_size=ep, **ENGINE)
    engine = llm.engine  # warmed up
    warm = engine.num_compilations
    cases = json.loads(REFERENCE.read_text())["tiny"][family]["cases"]
    params = SamplingParams(max_tokens=len(cases[0]["new_ids"]), temperature=0.0, ignore_eos=True)
    longest = next(c["prompt_ids"] for c in cases if len(c["prompt_ids"]) == 100)
    with count_xla_compilations() as serving_compiles:
        outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
        # the longest again: its blocks cached and its state snapshot kept at the last full one, restored
        [hit] = llm.generate([{"prompt_token_ids": longest}], params, use_tqdm=False)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "reference": None if wide else [c["new_ids"] for c in cases],
        "hit_tokens": hit.outputs[0].token_ids,
        "hit_cached": hit.num_cached_tokens,
        "compilations_after_warm_up": warm,
        "compilations_after_serving": engine.num_compilations,
        "xla_compilations_while_serving": len(serving_compiles),
        "accounting": accounting(engine),
        "arrays": array_shards(engine.runner),
        "mesh": dict(engine.runner.mesh.shape),
        "collectives": {
            "decode": collectives(engine.runner, ("decode", 4, 16)),
            "prefill": collectives(engine.runner, ("prefill", 64, 4, 16)),
        },
    }


def main(cases: list[str]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    results = {}
    for case in cases:  # "FAMILY:EPxTP[:wide]"
        family, layout, *variant = case.split(":")
        ep, tp = map(int, layout.split("x"))
        results[case] = run_layout(family, ep, tp, variant == ["wide"])
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
