"""KV blocks handed from one engine to another (prefill/decode disaggregation), engine side:
as host bytes and device to device through `jax.experimental.transfer` (here between two
transfer servers of one CPU process), a prompt of two staged chunks. The written blocks hold
the source's bytes, and the receiving engine generates the source's tokens from them; for a
model with K/V heads and for one with a latent cache (DeepSeek-V3)."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK

ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=128,
    max_model_len=512,
    block_size=8,
    num_blocks=160,
    decode_batch_buckets=(4,),
    block_table_buckets=(64,),
    prefill_token_buckets=(128,),
    prefill_seq_buckets=(4,),
)
NUM_BLOCKS = BLOCK_MOVE_CHUNK + 8  # two chunks
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def engines(request):
    """Two engines of a family: Llama's K/V heads, and DeepSeek-V3's latent cache (one latent
    per token, in two halves)."""
    model = build_tiny_random(family=request.param)
    return LLM(model, **ENGINE).engine, LLM(model, **ENGINE).engine


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 299, NUM_BLOCKS * 8 + 5).tolist()


def _tokens(engine, prompt: list[int]) -> list[int]:
    engine.add_prompt_ids(f"r{len(prompt)}-{prompt[0]}", prompt, GREEDY)
    out = []
    while engine.has_unfinished_requests():
        out += [t for d in engine.step() for t in d.token_ids]
    return out


@pytest.mark.parametrize("path", ["bytes", "device"])
def test_handed_blocks_hold_the_source_kv_and_give_its_tokens(engines, path, assert_kv_all_free):
    source, dest = engines
    prompt = _prompt({"bytes": 1, "device": 2}[path])
    want = _tokens(source, prompt)
    held = source.hold_prefix(prompt)
    assert held.num_blocks == NUM_BLOCKS
    k, v = source.read_kv_blocks(held, 0, NUM_BLOCKS)
    empty = dest.hold_prefix(prompt)
    assert empty.num_blocks == 0
    if path == "bytes":
        longer = dest.write_kv_blocks(empty, prompt, k, v)
    else:
        offering, pulling = source.start_device_transfer("127.0.0.1"), dest.start_device_transfer("127.0.0.1")
        staged = source.stage_kv_blocks(held, 0, NUM_BLOCKS)
        assert len(staged) == 4  # K and V of two chunks
        transfer_id = offering.offer(staged, offer_timeout=30)
        arrays = pulling.pull(offering.address, transfer_id, len(staged), timeout=60)
        longer = dest.write_staged_kv_blocks(empty, prompt, arrays, NUM_BLOCKS)
    assert longer.num_blocks == NUM_BLOCKS
    got_k, got_v = dest.read_kv_blocks(longer, 0, NUM_BLOCKS)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    source.release_hold(held)
    dest.release_hold(longer)
    computed = dest.stats.prompt_tokens_computed
    assert _tokens(dest, prompt) == want
    assert dest.stats.prompt_tokens_computed - computed == len(prompt) - NUM_BLOCKS * 8  # a prefix hit
    for engine in engines:
        assert_kv_all_free(engine)
