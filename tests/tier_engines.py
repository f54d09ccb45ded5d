"""What the engine tests of the KV tiers (host, disk, pool, their chain, quantized KV) share: the tiny
model's engine settings (a small pool, one bucket of each kind, prompts of a few blocks), greedy
sampling, random token-id prompts, and a run that gives each prompt's tokens and cached tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

TIER_ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    num_blocks=96,
    decode_batch_buckets=(4,),
    block_table_buckets=(32,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    kv_disk_min_load_tokens=16,
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def random_prompts(*lengths: int) -> list[list[int]]:
    """Prompt i: `lengths[i]` token ids drawn with seed i (the same prompts in every file)."""
    return [np.random.default_rng(i).integers(3, 250, n).tolist() for i, n in enumerate(lengths)]


def tier_llm(family: str = "llama", **settings: Any) -> LLM:
    """An `LLM` of the family's tiny random model with `TIER_ENGINE` and `settings` over it (not warmed up)."""
    return LLM(build_tiny_random(family=family), warm_up=False, **{**TIER_ENGINE, **settings})


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens and its cached prompt tokens."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]
