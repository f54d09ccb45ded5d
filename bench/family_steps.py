"""Decode step time per model family against a Llama of the same hidden size, served by the engine.

    python3 -m bench.family_steps [--models gemma3 mixtral ...] [--batch 1 4] [--tokens 32] [--rounds 5]

Each name is a family of `checkpoints.tiny_random.TINY_FAMILIES` (tiny random weights, hidden size 64
unless the family says otherwise); the baseline is the tiny `llama` with the family's hidden size,
built in the same process. A decode step's time is measured through `LLM.generate`, so it includes the
engine's host work (scheduling, inputs, sampling), which dominates at these sizes: the ratio says what
a family's layers add to a step, not how a real model of that family runs. Per batch size, `batch` new
random prompts of 16 tokens (never a prefix-cache hit) run once with 1 new token (prefill and one
sample) and once with `tokens + 1` new tokens (greedy, eos ignored); their difference over `tokens` is
the decode step time. Models take turns for `rounds` rounds and each keeps its best (the machine is
shared and noisy). Prints one line per family and batch: its step time, Llama's, and the ratio
(family / Llama: above 1 is slower).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from checkpoints.tiny_random import TINY_FAMILIES, build_tiny_random
from jaxserve import LLM, SamplingParams

ENGINE: dict[str, Any] = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=96,
    decode_batch_buckets=(1, 4),
    sampler_row_buckets=(1, 4),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
)


def decode_step_seconds(llm: LLM, batch: int, tokens: int, rng: np.random.Generator) -> float:
    """Seconds per decode step at `batch` sequences: (generate 1 + tokens) - (generate 1), over tokens;
    each run's prompts new (none is a prefix-cache hit, so both runs prefill alike)."""

    def run(new: int) -> float:
        prompts = rng.integers(20, 220, (batch, 16)).tolist()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    return max(run(1 + tokens) - run(1), 0.0) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    families = [f for f in TINY_FAMILIES if f != "llama"]
    parser.add_argument("--models", nargs="+", default=families, choices=families, metavar="FAMILY")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], choices=[1, 4])
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    engines: dict[str, LLM] = {}
    for family in args.models:
        engines[family] = LLM(build_tiny_random(family=family), **ENGINE)
        hidden = engines[family].engine.model_config.hidden_size
        engines.setdefault(f"llama-{hidden}", LLM(build_tiny_random(family="llama", hidden_size=hidden), **ENGINE))
    best = {(name, b): float("inf") for name in engines for b in args.batch}
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        for (name, b), seconds in best.items():
            best[name, b] = min(seconds, decode_step_seconds(engines[name], b, args.tokens, rng))
    for family in args.models:
        llama = f"llama-{engines[family].engine.model_config.hidden_size}"
        for b in args.batch:
            mine, base = best[family, b], best[llama, b]
            print(
                f"{family:<12} batch {b}: {mine * 1e3:7.2f} ms/step, {llama} {base * 1e3:7.2f} ms/step, "
                f"ratio {mine / base:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
