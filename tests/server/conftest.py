"""Real servers on loopback ports around one warmed-up tiny-random engine.

The engine is compiled once per test run (session scope) and shared by every server; each
server runs its own aiohttp `AppRunner` on its own event loop in a background thread, exactly as
`jaxserve serve` does (handler cancellation on, port chosen by the OS). Tests talk to them over
HTTP with real clients (`openai`, aiohttp, urllib).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Awaitable, Callable

import pytest
from aiohttp import web

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig
from server.engine_snapshot import EngineSnapshot, take_snapshot

MODEL_NAME = "tiny-random"
KEY_A = "key-alpha"
KEY_B = "key-bravo"
TEST_ENGINE = dict(
    max_num_seqs=64, max_num_batched_tokens=128, max_model_len=512, block_size=8, num_blocks=1024,
    decode_batch_buckets=(1, 4, 16, 64), block_table_buckets=(8, 64),
    prefill_token_buckets=(32, 128), prefill_seq_buckets=(1, 4),
)


class ServerThread:
    """An app served on 127.0.0.1:<free port> by an event loop in a daemon thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0)
        self.app = app
        self.port = self.run(self._start())
        self.base_url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return self._runner.addresses[0][1]

    def run(self, coro: Awaitable[Any], timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (where the engine's asyncio side lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def engine_call(self, engine: AsyncEngine, fn: Callable[[LLMEngine], Any]) -> Any:
        return self.run(engine.call(fn))

    def stop(self) -> None:
        try:
            self.run(self._runner.cleanup())
        except concurrent.futures.TimeoutError:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="session")
def async_engine():
    engine = LLMEngine(build_tiny_random(), EngineConfig(**TEST_ENGINE))
    engine.model_name = MODEL_NAME
    engine.warm_up()
    ae = AsyncEngine(engine)
    ae.start()
    yield ae
    ae.shutdown()


def start_server(async_engine: AsyncEngine, **config: Any) -> ServerThread:
    return ServerThread(build_app(async_engine, ServerConfig(served_model_name=MODEL_NAME, **config)))


@pytest.fixture(scope="session")
def server(async_engine):
    """The main server: keys A and B, no rate limits."""
    srv = start_server(async_engine, api_keys=(KEY_A, KEY_B))
    yield srv
    srv.stop()


def snapshot(srv: ServerThread, async_engine: AsyncEngine) -> EngineSnapshot:
    return srv.engine_call(async_engine, take_snapshot)


def wait_until_idle(srv: ServerThread, async_engine: AsyncEngine, timeout: float = 30.0) -> EngineSnapshot:
    """The engine's state once no request is left in it (aborts arrive within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(srv, async_engine)
        if not snap.has_unfinished and snap.kv_requests == 0:
            return snap
        if time.monotonic() > deadline:
            return snap
        time.sleep(0.05)


def check_kv_integrity(srv: ServerThread, async_engine: AsyncEngine) -> None:
    srv.engine_call(async_engine, lambda e: e.kv.check_integrity())
