"""The runner's one device state: programs take it over and update it in place (the parameters are
read, never copied), and a multi-host leader's mirrored operations, replayed by a second
runner, rebuild the same state (what a follower process does, here in one process)."""

from __future__ import annotations

import pickle

import jax
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.structured.spec import GuidedDecoding

SMALL = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=24,  # small enough that the batch below swaps (block moves are mirrored too)
    swap_space_blocks=16,
    preemption_mode="swap",
    decode_batch_buckets=(8,),
    block_table_buckets=(16,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
)


@pytest.fixture(scope="module")
def model():
    return build_tiny_random()


def prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(4, 40))).tolist()} for _ in range(n)]


def test_programs_update_the_state_in_place(model):
    llm = LLM(model, warm_up=True, **SMALL)
    runner = llm.engine.runner
    before = runner.state
    big = (before.cache, before.sampler.penalty_counts)  # what a copy per step would cost most
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(big)]
    llm.generate(prompts(4), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    after = runner.state
    # The cache and the penalty counts are in the buffers they started in: no program copied them
    # (taken over, donated, updated in place), and the parameters, which programs only read, are
    # the very arrays the runner started with.
    big = (after.cache, after.sampler.penalty_counts)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(big)] == pointers
    assert all(x.is_deleted() for x in jax.tree.leaves(before.updatable()))
    assert all(a is b for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params)))
    assert llm.engine.num_compilations == runner.executables.num_compilations > 0


def test_a_replaying_runner_rebuilds_the_leaders_state(model):
    leader = LLM(model, warm_up=False, **SMALL).engine
    follower = LLM(model, warm_up=False, **SMALL).engine.runner
    ops: list[bytes] = []
    leader.runner.mirror = lambda op: ops.append(pickle.dumps(op))  # as multihost.StepChannel sends them
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, frequency_penalty=0.5),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedDecoding("choice", ["yes", "no"])),
    ]
    for i, p in enumerate(prompts(6)):
        leader.add_prompt_ids(f"r{i}", p["prompt_token_ids"], params[i % len(params)])
    while leader.has_unfinished_requests():
        leader.step()
    kinds = {pickle.loads(op)[0] for op in ops}
    assert {"model", "sample", "move"} <= kinds
    for op in ops:
        follower.replay(pickle.loads(op))
    for mine, theirs in zip(jax.tree.leaves(leader.runner.state), jax.tree.leaves(follower.state)):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    with pytest.raises(ValueError, match="unknown mirrored operation"):
        follower.replay(("steps",))
