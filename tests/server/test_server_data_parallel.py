"""The server over two data-parallel replicas: requests spread by load, a session's turns stay
on the replica that holds its KV (so they reuse it), and ending a session frees it everywhere.

Both replicas run on the one default device: routing does not depend on where replicas run
(`jaxserve serve --data-parallel-size 2` on two devices is in tests/sharding/test_serve_processes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_harness import KEY_A, MODEL_NAME, TEST_ENGINE, send, snapshot, start_server, wait_until_idle
from test_server_sessions import cached, create, history_len, reused_blocks_of, turn

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine


@pytest.fixture(scope="module")
def dp_server():
    model = build_tiny_random()
    replicas = [LLMEngine(model, EngineConfig(**TEST_ENGINE)) for _ in range(2)]
    for engine in replicas:
        engine.warm_up()
    async_engine = AsyncEngine(DataParallelEngine(replicas))
    async_engine.start()
    srv = start_server(async_engine, api_keys=(KEY_A,))
    yield srv, async_engine
    srv.stop()
    async_engine.shutdown()
    async_engine.engine.close()


@contextlib.contextmanager
def replica_0_busy(srv, async_engine) -> Iterator[None]:
    """A long request occupies replica 0 (the tie-break pick) while the block runs."""
    with ThreadPoolExecutor(1) as pool:
        background = pool.submit(
            send,
            srv,
            "POST",
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "busy", "max_tokens": 480, "ignore_eos": True},
        )
        while srv.engine_call(async_engine, lambda dp: dp.loads()) != [1, 0]:
            time.sleep(0.02)
        yield
        assert background.result().status == 200


def _generated_per_replica(srv, async_engine) -> list[int]:
    return srv.engine_call(async_engine, lambda dp: [e.stats.generated_tokens for e in dp.replicas])


def test_concurrent_requests_spread_over_both_replicas(dp_server, assert_kv_all_free):
    srv, async_engine = dp_server
    before = _generated_per_replica(srv, async_engine)

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY_A, max_retries=0) as client:
            # Prompts with nothing in common: a shared prefix would rightly draw them together.
            calls = [
                client.completions.create(
                    model=MODEL_NAME,
                    prompt=f"{i} " * (i + 1),
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for i in range(8)
            ]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]

    texts = asyncio.run(run())
    assert len(texts) == 8
    after = _generated_per_replica(srv, async_engine)
    per_replica = [a - b for a, b in zip(after, before)]
    assert sum(per_replica) == 8 * 24 and min(per_replica) >= 24, per_replica  # both replicas served
    assert wait_until_idle(srv, async_engine).kv_requests == 0
    srv.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def test_a_session_stays_on_its_replica_and_reuses_its_kv(dp_server, assert_kv_all_free):
    srv, async_engine = dp_server
    with replica_0_busy(srv, async_engine):  # so the session's first turn goes to replica 1
        sid = create(srv)["id"]
        first = turn(srv, sid, "What is the capital of France?")
    assert srv.engine_call(async_engine, lambda dp: dp.loads()) == [0, 0]
    # Both replicas idle, and most of the next prompt is new: routing by load or by prefix
    # would pick replica 0; the session stays where its KV is.
    before = _generated_per_replica(srv, async_engine)
    second = turn(srv, sid, "And now a much longer question about Spain, its cities, rivers and history? " * 4)
    after = _generated_per_replica(srv, async_engine)
    assert after[1] - before[1] == second["usage"]["completion_tokens"] and after[0] == before[0]
    assert cached(second) >= reused_blocks_of(history_len(first))  # the first turn's KV was reused
    pins = srv.engine_call(async_engine, lambda dp: [len(e.kv.leases.pins()) for e in dp.replicas])
    assert pins == [0, 1]  # the session's history is pinned on its own replica

    assert send(srv, "DELETE", f"/v1/sessions/{sid}").status == 200
    assert srv.engine_call(async_engine, lambda dp: dp.route([1] * 64, sid)) == 0  # routed afresh
    assert wait_until_idle(srv, async_engine).kv_requests == 0
    srv.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def test_a_fork_joins_its_parent_on_the_replica_holding_the_shared_history(dp_server, assert_kv_all_free):
    srv, async_engine = dp_server
    with replica_0_busy(srv, async_engine):
        parent = create(srv)["id"]
        first = turn(srv, parent, "Tell me about the sea.")
    assert srv.engine_call(async_engine, lambda dp: dp.route([], parent)) == 1
    fork = send(srv, "POST", f"/v1/sessions/{parent}/fork", {}).json["id"]
    # Both replicas idle: by load the fork would go to replica 0; its history is on replica 1.
    assert srv.engine_call(async_engine, lambda dp: dp.route([], fork)) == 1
    forked = turn(srv, fork, "And about rivers?")
    assert cached(forked) >= reused_blocks_of(history_len(first))
    for sid in (parent, fork):
        assert send(srv, "DELETE", f"/v1/sessions/{sid}").status == 200
    assert wait_until_idle(srv, async_engine).kv_requests == 0
    srv.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def test_metrics_and_snapshot_count_both_replicas(dp_server):
    srv, async_engine = dp_server
    snap = snapshot(srv, async_engine)
    one_pool = srv.engine_call(async_engine, lambda dp: dp.replicas[0].kv.usage().num_blocks)
    assert snap.kv.num_blocks == 2 * one_pool
    metrics = send(srv, "GET", "/metrics", key=None).text
    for replica in ("0", "1"):
        assert f'jaxserve_replica_kv_usage_ratio{{replica="{replica}"}}' in metrics
        assert f'jaxserve_replica_num_requests{{replica="{replica}",state="running"}}' in metrics
    assert len(snap.replicas) == 2 and sum(r.kv_blocks for r in snap.replicas) == snap.kv.num_blocks
    models = send(srv, "GET", "/v1/models").json
    assert models["data"][0]["id"] == MODEL_NAME
