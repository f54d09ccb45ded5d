"""Fixtures: one warmed-up tiny-random engine for the whole run, shared by every test server.

Compiling is the slow part on CI (2 cores), so the engine is built once (session scope); each
server is cheap (an app on its own loop thread) and tests start extra ones with other settings.
"""

from __future__ import annotations

import dataclasses

import openai
import pytest
from server_harness import KEY_A, KEY_B, TEST_ENGINE, delete_stored_responses, start_server, wait_until_idle

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class WarmEngine:
    async_engine: AsyncEngine
    compilations_after_warm_up: int


@pytest.fixture(scope="session")
def warm_engine():
    engine = LLMEngine(build_tiny_random(), EngineConfig(**TEST_ENGINE))
    engine.warm_up()
    ae = AsyncEngine(engine)
    ae.start()
    yield WarmEngine(ae, engine.num_compilations)
    ae.shutdown()


@pytest.fixture(scope="session")
def async_engine(warm_engine):
    return warm_engine.async_engine


@pytest.fixture(scope="session")
def server(async_engine):
    """The main server: keys A and B, no rate limits."""
    srv = start_server(async_engine, api_keys=(KEY_A, KEY_B))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    """The official `openai` client on the main server, with key A."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)


@pytest.fixture
def stored_responses_cleared(server, async_engine, assert_kv_all_free):
    """After the test: its stored responses deleted (they pin KV), the engine idle, every KV block free."""
    yield
    delete_stored_responses(server)
    wait_until_idle(server, async_engine)
    server.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])
