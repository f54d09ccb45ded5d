"""One request's failure stays its own: a fault injected while building its inputs, its sampling
settings, checking its stops or detokenizing fails that request (finish_reason "error", blocks
freed) and every other request of the batch finishes with the tokens it gets without the fault."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams, faults
from jaxserve.async_engine import AsyncEngine
from jaxserve.engine import LLMEngine
from jaxserve.engine_client import EngineDeadError


@pytest.fixture(scope="module")
def llm():
    return LLM(
        build_tiny_random(),
        warm_up=False,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=8,
        num_blocks=300,
        decode_batch_buckets=(4, 16),
        block_table_buckets=(32,),
        sampler_row_buckets=(16,),
        prefill_token_buckets=(32, 64),
        prefill_seq_buckets=(1, 4),
    )


PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, seed=4, stop=["zz"], n=2),
]


def generate(llm, first_id: int):
    rng = np.random.default_rng(0)
    engine = llm.engine
    ids = [f"f{first_id + i}" for i in range(8)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, rng.integers(3, 250, 10 + 7 * i).tolist(), PARAMS[i % 2])
    out: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            entry = out.setdefault((d.request_id, d.index), [[], None, None])
            entry[0] += d.token_ids
            if d.finished:
                entry[1], entry[2] = d.finish_reason, d.error
    return ids, out


@pytest.mark.parametrize("point", faults.POINTS)
def test_a_fault_fails_only_the_chosen_request(llm, point, assert_kv_all_free):
    ids, clean = generate(llm, 0)
    ids2, faulty = (None, None)
    with faults.inject(point, "f102"):
        ids2, faulty = generate(llm, 100)
    for (rid, index), (tokens, reason, error) in faulty.items():
        if rid == "f102":
            assert reason == "error" and "injected fault" in error
        else:
            twin = clean[(ids[ids2.index(rid)], index)]
            assert (tokens, reason, error) == tuple(twin), rid
    assert llm.engine.stats.failed_requests > 0
    assert_kv_all_free(llm.engine)
    # the engine goes on serving
    assert generate(llm, 200)[1][("f200", 0)] == clean[("f0", 0)]


def test_a_failing_device_step_stops_the_loop_and_says_so(llm):
    """Only the device iteration itself is fatal: every waiting stream gets EngineDeadError and
    `on_fatal` runs (the server then exits non-zero for its supervisor)."""
    engine = LLMEngine(build_tiny_random(), llm.engine.config)
    async_engine = AsyncEngine(engine)
    errors: list[BaseException] = []
    died = threading.Event()
    async_engine.on_fatal = lambda e: (errors.append(e), died.set())

    def device_lost(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.run_model = device_lost
    async_engine.start()

    async def generate() -> None:
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in async_engine.generate("dead", [5, 6, 7], SamplingParams(max_tokens=3)):
                pass

    asyncio.run(generate())
    assert died.wait(10) and "device lost" in str(errors[0])
    assert not async_engine.is_alive
