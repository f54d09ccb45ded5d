"""The tiny Mistral (a sliding window of 8 tokens, shorter than the prompts) and the engine settings the
sliding-window engine tests share: blocks of 4 tokens, prefill chunks of 16."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from checkpoints.loaded import LoadedModel
from checkpoints.tiny_random import build_tiny_random

REFERENCE = json.loads((Path(__file__).parent / "data" / "family_reference.json").read_text())["tiny"]["mistral"]
WINDOW, BS = 8, 4
CONFIG = dict(
    max_num_seqs=4,
    max_num_batched_tokens=16,  # prompts of 21 and 45 tokens take several chunks
    max_model_len=128,
    block_size=BS,
    num_blocks=64,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(16,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(32,),
)
LONG = [int(t) for t in np.random.default_rng(7).integers(3, 250, 56)]


def tiny_mistral() -> LoadedModel:
    """The reference's random Mistral (the weights transformers answered for)."""
    built = build_tiny_random(family="mistral", seed=REFERENCE["seed"])
    assert built.config.sliding_window == WINDOW
    return built
