"""Fixtures: one warmed-up tiny-random engine for the whole run, shared by every test server.

Compiling is the slow part on CI (2 cores), so the engine is built once (session scope); each
server is cheap (an app on its own loop thread) and tests start extra ones with other settings.
"""

from __future__ import annotations

import dataclasses

import pytest
from server_harness import KEY_A, KEY_B, TEST_ENGINE, start_server

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
