"""What structured output costs: a constrained row against an unconstrained one, and what one
constrained row in a batch costs the others.

Runs, in one process and interleaved over rounds, a batch of `--batch` requests of `--tokens`
tokens each (ignore_eos, so every row runs to the end): all unconstrained; one constrained by a
JSON schema whose string never closes (so its grammar stays live for the whole run) and the rest
unconstrained; all constrained. Prints, per run, the unconstrained rows' tokens/s, the
constrained rows' seconds per token, and the host time llguidance spends per constrained token
(mask + advance, replayed on the run's own tokens), with ratios against the unconstrained run.

    PYTHONPATH=. python -m bench.structured_cost [--model smollm2-135m-instruct] [--batch 8] [--tokens 32]
        [--rounds 3] [--no-async-scheduling]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from checkpoints.registry import DEFAULT_MODEL, load_model
from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import GuidedDecoding, mask_words

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def run_batch(engine: LLMEngine, batch: int, constrained: int, tokens: int, tag: str) -> dict[str, float]:
    """Generate one batch; seconds until each group's last request finished, and its tokens."""
    plain = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    guided = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, guided=GuidedDecoding("json", SCHEMA))
    groups = {}
    for i in range(batch):
        is_guided = i < constrained
        engine.add_request(f"{tag}-{i}", "Tell me a long story about a dragon.", guided if is_guided else plain)
        groups[f"{tag}-{i}"] = "constrained" if is_guided else "plain"
    finished: dict[str, float] = {}
    outputs: dict[str, list[int]] = {rid: [] for rid in groups}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
            if delta.finish_reason is not None:
                finished[delta.request_id] = time.perf_counter() - t0
    result = {}
    for group in ("plain", "constrained"):
        ids = [rid for rid, g in groups.items() if g == group]
        if ids:
            result[f"{group}_seconds"] = max(finished[rid] for rid in ids)
            result[f"{group}_tokens"] = sum(len(outputs[rid]) for rid in ids)
    result["replay"] = next((outputs[rid] for rid, g in groups.items() if g == "constrained"), [])
    return result


def grammar_seconds_per_token(engine: LLMEngine, token_ids: list[int]) -> float:
    """Host time of llguidance for one constrained token: the mask, then the advance."""
    state = engine.grammars.states(GuidedDecoding("json", SCHEMA), 1)[0]
    mask = np.empty(mask_words(engine.model_config.vocab_size), np.int32)
    t0 = time.perf_counter()
    for token in token_ids:
        state.write_mask(mask)
        state.advance(token)
    return (time.perf_counter() - t0) / max(1, len(token_ids))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a registry name, or tiny-random")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    config = EngineConfig(
        max_num_seqs=args.batch,
        max_num_batched_tokens=256,
        max_model_len=256,
        block_size=16,
        num_blocks=4 * args.batch * (256 // 16),
        decode_batch_buckets=(args.batch,),
        prefill_token_buckets=(256,),
        prefill_seq_buckets=(args.batch,),
        block_table_buckets=(16,),
        async_scheduling=args.async_scheduling,
    )
    model = build_tiny_random() if args.model == "tiny-random" else load_model(args.model)
    engine = LLMEngine(model, config)
    engine.warm_up()
    _ = engine.grammars.ll_tokenizer  # built once, outside the timings
    runs = {"all plain": 0, "1 constrained": 1, "all constrained": args.batch}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    run_batch(engine, args.batch, 1, 4, "warm")  # first steps of each kind, not timed
    for r in range(args.rounds):
        for name, constrained in runs.items():
            samples[name].append(run_batch(engine, args.batch, constrained, args.tokens, f"{name}-{r}"))
    print(
        f"model {args.model}, batch {args.batch}, {args.tokens} tokens per row, median of {args.rounds} rounds, "
        f"async scheduling {'on' if args.async_scheduling else 'off'}"
    )

    def per_token(name: str, group: str) -> float:  # seconds per token of one row of the group
        rows = [s for s in samples[name] if f"{group}_tokens" in s]
        count = runs[name] if group == "constrained" else args.batch - runs[name]
        return statistics.median(s[f"{group}_seconds"] / (s[f"{group}_tokens"] / count) for s in rows)

    base = per_token("all plain", "plain")
    print(f"  all plain:       plain rows {1e3 * base:7.2f} ms/token ({args.batch / base:7.1f} tok/s for the batch)")
    plain = per_token("1 constrained", "plain")
    one = per_token("1 constrained", "constrained")
    print(
        f"  1 constrained:   plain rows {1e3 * plain:7.2f} ms/token ({plain / base:.2f}x), "
        f"the constrained row {1e3 * one:7.2f} ms/token ({one / base:.2f}x)"
    )
    every = per_token("all constrained", "constrained")
    print(f"  all constrained: rows {1e3 * every:7.2f} ms/token ({every / base:.2f}x)")
    llg = grammar_seconds_per_token(engine, samples["1 constrained"][-1]["replay"])
    print(f"  llguidance host time per constrained token (mask + advance): {1e3 * llg:.3f} ms")


if __name__ == "__main__":
    main()
