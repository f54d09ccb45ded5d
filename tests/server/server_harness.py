"""Helpers for the server tests: real servers on loopback ports, plain HTTP calls, SSE parsing.

Each server runs its own aiohttp `AppRunner` on its own event loop in a background thread, as
`jaxserve serve` does (handler cancellation on, port chosen by the OS). Tests talk to them over
HTTP with real clients (`openai`, aiohttp, http.client).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.engine_snapshot import EngineSnapshot
from server.app import build_app
from server.auth import owner_id
from server.config import ServerConfig
from server.state import STATE

MODEL_NAME = "tiny-random"
KEY_A = "key-alpha"
KEY_B = "key-bravo"
BLOCK_SIZE = 8
# Few buckets: every one costs seconds of compilation on a 2-core CI machine, and padding a
# tiny model's step to a bigger bucket costs next to nothing.
TEST_ENGINE = dict(
    max_num_seqs=64,
    max_num_batched_tokens=128,
    max_model_len=512,
    block_size=BLOCK_SIZE,
    num_blocks=1024,
    decode_batch_buckets=(4, 64),
    block_table_buckets=(64,),
    prefill_token_buckets=(128,),
    prefill_seq_buckets=(4,),
    sampler_row_buckets=(64,),
)


class ServerThread:
    """An app served on 127.0.0.1:<free port> by an event loop in a daemon thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        config = app[STATE].config
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=5.0,
            keepalive_timeout=config.keepalive_timeout,
            lingering_time=config.body_timeout,
        )
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

    def engine_call(self, engine: AsyncEngine, fn: Callable[[DataParallelEngine], Any]) -> Any:
        return self.run(engine.inspect(fn))

    def stop(self) -> None:
        try:
            self.run(self._runner.cleanup())
        except concurrent.futures.TimeoutError:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def running_engine(model: Any, config: EngineConfig) -> Iterator[AsyncEngine]:
    """An engine of `model` (a registry name or a loaded model), warmed up and started behind the
    async interface; shut down on leaving."""
    engine = LLMEngine(model, config)
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        yield async_engine
    finally:
        async_engine.shutdown()


def start_server(async_engine: AsyncEngine, **config: Any) -> ServerThread:
    return ServerThread(build_app(async_engine, ServerConfig(served_model_name=MODEL_NAME, **config)))


def snapshot(srv: ServerThread, async_engine: AsyncEngine) -> EngineSnapshot:
    return srv.run(async_engine.snapshot())


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


def delete_stored_responses(srv: ServerThread, timeout: float = 30.0) -> None:
    """Delete every stored response of the server (they pin KV), once background responses and the
    pins made after replies are done."""
    state = srv.app[STATE]
    deadline = time.monotonic() + timeout
    while (state.background or any(s.busy for s in state.sessions.all())) and time.monotonic() < deadline:
        time.sleep(0.05)

    async def delete_all() -> None:
        for session in state.sessions.all():
            if session.response is not None:
                await state.responses.remove(session)

    srv.run(delete_all())


def check_kv_integrity(srv: ServerThread, async_engine: AsyncEngine) -> None:
    srv.engine_call(async_engine, lambda dp: [e.kv.check_integrity() for e in dp.replicas])


def assert_serving_and_idle(srv: ServerThread, async_engine: AsyncEngine, key: str) -> None:
    """After a storm of requests with `key`: /health is ok; once the key's sessions (and stored
    responses) are deleted no request is left in the engine, no KV block is held or pinned for the
    key, the pool's books balance, and a new request is served in full."""
    assert send(srv, "GET", "/health", key=None).json == {"status": "ok"}
    for session in send(srv, "GET", "/v1/sessions", key=key).json["data"]:
        assert send(srv, "DELETE", f"/v1/sessions/{session['id']}", key=key).status == 200
    delete_stored_responses(srv)
    snap = wait_until_idle(srv, async_engine)
    assert not snap.has_unfinished and snap.kv_requests == 0 and snap.kv.used == 0
    check_kv_integrity(srv, async_engine)
    owner = owner_id(key)

    def pinned() -> int:
        return srv.engine_call(async_engine, lambda dp: sum(e.kv.leases.pinned_by(owner) for e in dp.replicas))

    deadline = time.monotonic() + 10  # unpinning runs on the engine thread after the deletes
    while pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pinned() == 0
    reply = send(
        srv,
        "POST",
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
        key=key,
    )
    assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 3


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str

    @property
    def json(self) -> Any:
        return json.loads(self.text)


def send(
    srv: ServerThread,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = KEY_A,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Reply:
    """One plain HTTP request (stdlib client): `body` is sent as JSON, `raw` as is."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        all_headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        conn.request(method, path, body=data, headers=all_headers)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode())
    finally:
        conn.close()


async def stream_events(resp: Any) -> AsyncIterator[Any]:
    """The `data:` payloads of a streaming aiohttp response as they arrive: parsed JSON, or "[DONE]"."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON, or the string "[DONE]"."""
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
