"""Runs the engine loop in its own thread and gives each request an async stream of deltas.

The asyncio side never calls JAX: requests and aborts go into a thread-safe inbox; deltas
come back to each request's asyncio.Queue through `loop.call_soon_threadsafe`.

The loop drives a `DataParallelRouter`: a lone `LLMEngine` is wrapped in a router of one, so
requests that name a session reach the replica holding the session's KV either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable

from jaxserve.dp_router import DataParallelRouter
from jaxserve.engine import LLMEngine
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.kv import Pin
from jaxserve.outputs import Delta
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


ENGINE_CALL_TIMEOUT = 30.0  # seconds a call on the engine thread may wait for a step to end


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (its part of a step raised); others go on."""


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    session_id: str | None
    deliver: Callable[[Delta | BaseException], None]
    on_finish: Callable[[DataParallelRouter, Delta], None] | None = None


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    """Run fn(router) on the engine thread (session pins, snapshots)."""

    fn: Callable[[DataParallelRouter], Any]
    done: Callable[[Any], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine | DataParallelRouter):
        self.engine = engine if isinstance(engine, DataParallelRouter) else DataParallelRouter([engine])
        self._inbox: queue.Queue = queue.Queue()
        self._deliver: dict[str, Callable[[Delta | BaseException], None]] = {}
        self._on_finish: dict[str, Callable[[DataParallelRouter, Delta], None]] = {}
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._stopping = threading.Event()
        self.last_step_at = time.monotonic()
        self.fatal_error: BaseException | None = None
        self.on_step: Callable[[DataParallelRouter, list[Delta], float], None] | None = None  # metrics hook
        # Called on the engine thread when it wakes with nothing to run (multi-host keep-alive).
        self.on_idle: Callable[[], None] | None = None
        # Called on the engine thread once the loop has died (a device step failed) and every
        # waiting stream has its error: the server exits non-zero so a supervisor restarts it.
        self.on_fatal: Callable[[BaseException], None] | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       session_id: str | None = None,
                       on_finish: Callable[[DataParallelRouter, Delta], None] | None = None) -> AsyncIterator[Delta]:
        """Stream the request's deltas. Raises ValueError for a prompt the engine cannot serve.
        Leaving the iteration early (client gone, task cancelled) aborts the request. Requests
        that name a `session_id` go to the replica that served the session before.
        `on_finish(router, final_delta)` (n = 1 only) runs on the engine thread as the sequence
        ends, before any later step: a prefill worker holds the prompt's blocks there."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def deliver(item: Delta | BaseException) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # the caller's event loop has closed: no one reads this stream now
                self._inbox.put(_Abort(request_id))

        if on_finish is not None and params.n != 1:
            raise ValueError("on_finish needs n = 1")
        self._inbox.put(_Add(request_id, prompt, params, session_id, deliver, on_finish))
        remaining = params.n
        finished = False
        try:
            while remaining:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
            finished = True
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def health_details(self) -> dict[str, Any]:
        """What `/health` adds to its status: nothing for one process (a router lists its workers)."""
        return {}

    # ----- the engine API, on the engine thread between steps (None once the loop has stopped) -

    async def snapshot(self) -> EngineSnapshot | None:
        return await self._on_engine_thread(DataParallelRouter.snapshot)

    async def pin_history(self, session_id: str, owner: str, token_ids: list[int], old: Pin | None,
                          others: list[Pin]) -> tuple[Pin | None, list[Pin]] | None:
        """See `LLMEngine.pin_history`; the pin is made on the replica holding the session."""
        return await self._on_engine_thread(lambda e: e.pin_history(session_id, owner, token_ids, old, others))

    async def unpin(self, pin: Pin) -> None:
        await self._on_engine_thread(lambda e: e.unpin(pin))

    async def end_sessions(self, ended: list[tuple[str, Pin | None]]) -> None:
        """Sessions that are gone: release each one's pin and its place on a replica."""
        def end(router: DataParallelRouter) -> None:
            for session_id, pin in ended:
                router.end_session(session_id, pin)
        await self._on_engine_thread(end)

    async def set_pin_budget(self, blocks_per_owner: int) -> None:
        await self._on_engine_thread(lambda e: e.set_pin_budget(blocks_per_owner))

    async def between_steps(self, fn: Callable[[DataParallelRouter], Any]) -> Any:
        """Run fn(router) on the engine thread between steps (a worker's KV transfers)."""
        return await self._on_engine_thread(fn)

    async def inspect(self, fn: Callable[[DataParallelRouter], Any]) -> Any:
        """Run fn(router) on the engine thread: for tests and debugging tools, which may look at
        any internal state. The server uses only the methods above."""
        return await self._on_engine_thread(fn)

    async def _on_engine_thread(self, fn: Callable[[DataParallelRouter], Any]) -> Any:
        if not self.is_alive:
            return None
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result: Any) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
            loop.call_soon_threadsafe(settle)

        self._inbox.put(_Call(fn, done))
        return await asyncio.wait_for(fut, ENGINE_CALL_TIMEOUT)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and stop the loop."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()  # the disk tier's last writes

    # ----- the engine thread ----------------------------------------------------------------

    def _handle(self, item: Any) -> None:
        engine = self.engine
        if isinstance(item, _Add):
            try:
                engine.add_request(item.request_id, item.prompt, item.params, item.session_id)
                self._deliver[item.request_id] = item.deliver
                if item.on_finish is not None:
                    self._on_finish[item.request_id] = item.on_finish
            except ValueError as e:  # the request cannot be served: the caller's error
                item.deliver(e)
            except Exception as e:  # noqa: BLE001 - this request failed alone; the engine goes on
                logger.exception("adding request %s failed", item.request_id)
                item.deliver(RequestFailedError(f"{type(e).__name__}: {e}"))
        elif isinstance(item, _Abort):
            for d in engine.abort(item.request_id):
                self._send(d)
            self._deliver.pop(item.request_id, None)
        elif isinstance(item, _Call):
            try:
                item.done(item.fn(engine))
            except Exception as e:  # handed to the awaiting coroutine
                item.done(e)

    def _send(self, d: Delta) -> None:
        on_finish = self._on_finish.pop(d.request_id, None) if d.finished else None
        if on_finish is not None:
            try:
                on_finish(self.engine, d)
            except Exception:  # noqa: BLE001 - the request's output stands; the hook's work is lost
                logger.exception("on_finish of request %s failed", d.request_id)
        deliver = self._deliver.get(d.request_id)
        if deliver is not None:
            deliver(d if d.error is None else RequestFailedError(d.error))

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                block = not engine.has_unfinished_requests()
                try:
                    item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                    if item is not None:
                        self._handle(item)
                    while True:  # drain whatever else arrived
                        item = self._inbox.get_nowait()
                        if item is not None:
                            self._handle(item)
                except queue.Empty:
                    pass
                if engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    deltas = engine.step()
                    for d in deltas:
                        self._send(d)
                    for rid in [r for r in self._deliver if not engine.is_active(r)]:
                        del self._deliver[rid]
                        self._on_finish.pop(rid, None)
                    if self.on_step is not None:
                        self.on_step(engine, deltas, time.perf_counter() - t0)
                elif self.on_idle is not None:
                    self.on_idle()
                self.last_step_at = time.monotonic()
        except BaseException as e:  # the loop died: fail every waiting stream loudly
            logger.exception("engine loop failed")
            self.fatal_error = e
            for deliver in self._deliver.values():
                deliver(EngineDeadError(f"engine loop failed: {e!r}"))
            self._deliver.clear()
            self._on_finish.clear()
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        for rid in list(self._deliver):
            for d in engine.abort(rid):
                self._send(d)
        self._deliver.clear()
