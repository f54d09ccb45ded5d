"""Prefix-cache hit rate of a multi-turn workload on a Gated DeltaNet hybrid, with state snapshots
(prefix caching on) and without (off), beside a full-attention model of the same sizes.

Each conversation's turn t sends the whole history (turn t - 1's prompt and answer) and a new user
message of random tokens, greedy, to the tiny random models (`checkpoints.tiny_random`); the hit rate
is cached prompt tokens over prompt tokens, as the engine reports them (`num_cached_tokens`). A
hybrid resumes only where a snapshot of its state was kept: at the last block boundary of each
prompt, so a turn hits its history up to the previous prompt, and recomputes the previous answer.

    python3 -m bench.hybrid_prefix_hits
"""

from __future__ import annotations

import numpy as np

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024, block_size=16, num_blocks=512)


def hit_rate(family: str, prefix_caching: bool, conversations: int = 4, turns: int = 5, seed: int = 0) -> float:
    """Cached prompt tokens over prompt tokens of the workload on the tiny model of `family`."""
    llm = LLM(build_tiny_random(family=family), **ENGINE, enable_prefix_caching=prefix_caching)
    rng = np.random.default_rng(seed)
    histories = [[] for _ in range(conversations)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt_tokens = cached = 0
    for _ in range(turns):
        prompts = [h + [int(t) for t in rng.integers(3, 290, int(rng.integers(20, 60)))] for h in histories]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            prompt_tokens += len(prompt)
            cached += out.num_cached_tokens
            histories[i] = prompt + list(out.outputs[0].token_ids)
    return cached / prompt_tokens


def main() -> None:
    print("| model | prefix caching | hit rate |\n| --- | --- | --- |")
    for family, caching in (("qwen3_5", True), ("qwen3_5", False), ("qwen3", True)):
        print(f"| tiny {family} | {'on' if caching else 'off'} | {hit_rate(family, caching):.1%} |", flush=True)


if __name__ == "__main__":
    main()
