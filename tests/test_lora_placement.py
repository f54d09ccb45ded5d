"""LoRA across data-parallel replicas and off the engine thread, on the tiny random Llama: a
request goes to a replica holding its adapter in a LoRA slot, and is credited only its adapter's cached
prefix (never the base model's or another adapter's); adapters are read from disk in a worker
thread (loads and requests whose host copy was dropped), and their tokens still equal
transformers + PEFT's.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from lora_harness import LORA_ENGINE, TINY_ADAPTERS, reference_runs, write_tiny_adapters

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.placement import PlacementPolicy
from jaxserve.sampling_params import SamplingParams

ONE_LORA_SLOT = {**LORA_ENGINE, "max_loras": 1, "max_cpu_loras": 1}
FIRST, SECOND = TINY_ADAPTERS[0].name, TINY_ADAPTERS[1].name


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_tiny_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def replicas():
    model = build_tiny_random()
    config = EngineConfig(**ONE_LORA_SLOT)
    # Loads count as far apart from 16 sequences (SGLang's default is 64).
    policy = PlacementPolicy(match_fraction=0.5, balance_abs=16)
    return DataParallelEngine([LLMEngine(model, config), LLMEngine(model, config)], policy)


def greedy(name: str | None, max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=name)


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_replicas_holding_the_adapter_attract_its_requests_and_credit_only_its_kv(replicas, adapters):
    for spec in TINY_ADAPTERS[:2]:
        replicas.adapters.add(spec.name, str(adapters[spec.name]))
    cached, other = list(range(10, 43)), list(range(50, 83))  # 4 full blocks of 8 each
    holder = replicas.replicas[1]
    holder.add_prompt_ids("first-on-1", cached, greedy(FIRST))
    run_to_end(holder)
    assert replicas.loads() == [0, 0]  # ties would go to replica 0
    assert replicas.route(cached, lora=FIRST) == 1  # its prefix and its LoRA slot
    assert replicas.route(other, lora=FIRST) == 1  # its LoRA slot alone
    assert replicas.route(cached, lora=SECOND) == 0  # the first adapter's KV is not the second's
    assert replicas.route(cached) == 0  # nor the base model's
    replicas.add_request("second", cached, greedy(SECOND))
    assert replicas.replicas[0].is_active("second")
    run_to_end(replicas.replicas[0])
    assert replicas.route(other, lora=SECOND) == 0
    # Loads far apart override the LoRA slot: the busy replica's adapter goes to the idle one.
    for i in range(20):
        holder.add_prompt_ids(f"busy-{i}", other, greedy(None, 1))
    assert replicas.route(other, lora=FIRST) == 0
    run_to_end(holder)


def test_adapters_are_read_off_the_engine_thread(replicas, adapters):
    read_on: list[str] = []
    for engine in replicas.replicas:
        manager, read = engine.lora, engine.lora.read

        def recording_read(path: str, read=read) -> object:
            read_on.append(threading.current_thread().name)
            return read(path)

        manager.read = recording_read
    async_engine = AsyncEngine(replicas)
    async_engine.start()
    name = TINY_ADAPTERS[2].name
    prompt, expected = next((p, ids) for n, p, ids in reference_runs() if n == FIRST)

    async def scenario() -> list[int]:
        await async_engine.load_lora_adapter(name, str(adapters[name]))  # drops FIRST's host copy (one kept)
        assert replicas.adapters.missing_host_copy(FIRST) is not None
        tokens: list[int] = []
        async for delta in async_engine.generate("r", prompt, greedy(FIRST, len(expected))):
            tokens += delta.token_ids
        return tokens

    try:
        tokens = asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    assert tokens == expected
    assert len(read_on) == 2 and "jaxserve-engine" not in read_on  # the load, then FIRST again
    assert name in replicas.adapters.served()
