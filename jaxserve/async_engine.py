"""The engine of this process behind `EngineClient`: the engine loop in its own thread, and an async
stream of deltas for each request.

The asyncio side never calls JAX: requests, aborts and calls (snapshots, pins, KV transfers) go
into a thread-safe inbox that the loop drains between steps; deltas and results come back through
`loop.call_soon_threadsafe`.

The loop drives a `DataParallelEngine`: a lone `LLMEngine` is wrapped in one of one replica, so
requests that name a session reach the replica holding the session's KV either way. KV export and
import (`KVTransferEngine`, in `jaxserve.async_kv_transfer`) need one replica. Replicas are used
through `EngineCore` only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from checkpoints.encoders.config import EncoderConfig
from jaxserve import kv_transfer
from jaxserve.async_kv_transfer import AsyncKVTransfer
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.engine_client import (
    EngineDeadError,
    EngineInfo,
    KVHold,
    Pin,
    RequestFailedError,
    merge_choices,
)
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.image_prompt import MultimodalPrompt, cache_token_ids
from jaxserve.outputs import Delta, FinishReason
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


ENGINE_CALL_TIMEOUT = 30.0  # seconds a call on the engine thread may wait for a step to end


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: str | list[int] | MultimodalPrompt
    params: SamplingParams
    session_id: str | None
    deliver: Callable[[Delta | BaseException], None]
    hold_kv: bool = False


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    """Run fn(the data-parallel engine) on the engine thread (session pins, snapshots)."""

    fn: Callable[[DataParallelEngine], Any]
    done: Callable[[Any], None]


class AsyncEngine(AsyncKVTransfer):
    """`EngineClient` and `KVTransferEngine` (one replica) over the engine loop of this process."""

    def __init__(self, engine: LLMEngine | DataParallelEngine):
        self.engine = engine if isinstance(engine, DataParallelEngine) else DataParallelEngine([engine])
        e = self.engine
        self.info = EngineInfo(
            model_name=str(e.model_name),
            tokenizer=e.tokenizer,
            vocab_size=e.model_config.vocab_size,
            max_model_len=e.config.max_model_len,
            max_num_seqs=e.max_num_seqs,
            block_size=e.config.block_size,
            hidden_size=e.model_config.hidden_size,
            encoder=e.model_config if isinstance(e.model_config, EncoderConfig) else None,
            vision=e.vision,
        )
        self._inbox: queue.Queue = queue.Queue()
        self._deliver: dict[str, Callable[[Delta | BaseException], None]] = {}
        self._hold_kv: dict[str, list[int]] = {}  # request id -> prompt ids, for `generate(hold_kv=True)`
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._stopping = threading.Event()
        self.last_step_at = time.monotonic()
        self.fatal_error: BaseException | None = None
        self.on_step: Callable[[float], None] | None = None  # the server's step-time histogram
        # Called on the engine thread when it wakes with nothing to run (multi-host keep-alive).
        self.on_idle: Callable[[], None] | None = None
        # Called on the engine thread once the loop has died (a device step failed) and every
        # waiting stream has its error: the server exits non-zero so a supervisor restarts it.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.on_stopped: Callable[[], None] | None = None  # once, after `shutdown` (multi-host: free the followers)
        self._transfer: kv_transfer.DeviceTransfer | None = None
        self._kv_fingerprint: bytes | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams,
        session_id: str | None = None,
        hold_kv: bool = False,
    ) -> AsyncIterator[Delta]:
        """See `EngineClient.generate`. With `hold_kv` the prompt's blocks are held on the engine
        thread as the sequence ends, before any later step could evict them."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        closed = False  # the caller has left: what still arrives is dropped (held KV released)

        def put(item: Delta | BaseException) -> None:  # on the event loop
            if closed:
                self._release_unread(item)
            else:
                out.put_nowait(item)

        def deliver(item: Delta | BaseException) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(put, item)
            except RuntimeError:  # the caller's event loop has closed: no one reads this stream now
                self._inbox.put(_Abort(request_id))
                self._release_unread(item)

        if hold_kv and (params.n != 1 or isinstance(prompt, str)):
            raise ValueError("hold_kv needs n = 1 and the prompt's token ids (with its images), not text")
        if params.lora is not None:
            await self._read_lora_host_copy(params.lora)
        self._inbox.put(_Add(request_id, prompt, params, session_id, deliver, hold_kv))
        finished = False
        try:
            async for item in merge_choices(out, params.n):
                yield item
            finished = True
        finally:
            closed = True
            if not finished:
                self._inbox.put(_Abort(request_id))
            while not out.empty():
                self._release_unread(out.get_nowait())

    def _release_unread(self, item: Delta | BaseException) -> None:
        """A delivered delta no one will read may carry held KV: release it on the engine thread."""
        hold = getattr(item, "kv_hold", None)
        if hold is not None:
            self._inbox.put(_Call(lambda e: e.lone_replica.release_hold(hold), lambda _result: None))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def health_details(self) -> dict[str, Any]:
        """What `/health` adds to its status: nothing for one process (a router lists its workers)."""
        return {}

    def running_capacity(self) -> int:
        return self.info.max_num_seqs

    # ----- the engine API, on the engine thread between steps (None once the loop has stopped) -

    async def snapshot(self) -> EngineSnapshot | None:
        return await self._on_engine_thread(DataParallelEngine.snapshot)

    async def pin_history(
        self,
        session_id: str,
        owner: str,
        token_ids: list[int],
        old: Pin | None,
        others: list[Pin],
        lora: str | None = None,
    ) -> tuple[Pin | None, list[Pin]] | None:
        """See `EngineClient.pin_history`; the pin is made on the replica holding the session."""
        return await self._on_engine_thread(lambda e: e.pin_history(session_id, owner, token_ids, old, others, lora))

    async def unpin(self, pin: Pin) -> None:
        await self._on_engine_thread(lambda e: e.unpin(pin))

    async def end_sessions(self, ended: list[tuple[str, Pin | None]]) -> None:
        """Sessions that are gone: release each one's pin and its place on a replica."""

        def end(engine: DataParallelEngine) -> None:
            for session_id, pin in ended:
                engine.end_session(session_id, pin)

        await self._on_engine_thread(end)

    async def set_pin_budget(self, blocks_per_owner: int) -> None:
        await self._on_engine_thread(lambda e: e.set_pin_budget(blocks_per_owner))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Read the adapter in a worker thread (steps go on meanwhile); only registering it and
        its host copy runs on the engine thread."""
        weights = await asyncio.get_running_loop().run_in_executor(None, self.engine.adapters.read, path)
        await self._on_engine_thread(lambda e: e.adapters.add(name, path, weights))

    async def _read_lora_host_copy(self, name: str) -> None:
        """A request's adapter whose host copy was dropped (past `max_cpu_loras`) is read again in
        a worker thread before the request reaches the engine thread, so no step waits for the
        disk. A bad or vanished directory is left for the engine to report with the request."""
        path = self.engine.adapters.missing_host_copy(name)
        if path is None:
            return
        try:
            weights = await asyncio.get_running_loop().run_in_executor(None, self.engine.adapters.read, path)
        except (OSError, ValueError):
            return
        await self._on_engine_thread(lambda e: e.adapters.keep(name, path, weights))

    async def unload_lora_adapter(self, name: str) -> None:
        await self._on_engine_thread(lambda e: e.adapters.remove(name))

    async def lora_adapters(self) -> dict[str, str] | None:
        return await self._on_engine_thread(lambda e: e.adapters.served())

    async def aclose(self) -> None:
        """`shutdown` without blocking the event loop (its last deliveries still land)."""
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    async def inspect(self, fn: Callable[[DataParallelEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread: for tests and debugging tools, which may look at
        any internal state. Not part of `EngineClient`: the server and the cluster never call it."""
        return await self._on_engine_thread(fn)

    # ----- the engine thread ------------------------------------------------------------------

    async def _on_engine_thread(self, fn: Callable[[DataParallelEngine], Any]) -> Any:
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
        stopped, self.on_stopped = self.on_stopped, None
        if stopped is not None:
            stopped()

    # ----- the engine thread ----------------------------------------------------------------

    def _handle(self, item: Any) -> None:
        engine = self.engine
        if isinstance(item, _Add):
            try:
                engine.add_request(item.request_id, item.prompt, item.params, item.session_id)
                self._deliver[item.request_id] = item.deliver
                if item.hold_kv:  # held as the prefix cache keys the prompt (its images salted)
                    p = item.prompt
                    multimodal = isinstance(p, MultimodalPrompt)
                    self._hold_kv[item.request_id] = cache_token_ids(p.token_ids, p.images) if multimodal else p
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
        prompt_ids = self._hold_kv.pop(d.request_id, None) if d.finished else None
        if prompt_ids is not None and d.finish_reason == FinishReason.LENGTH.value:
            try:
                d.kv_hold = self._hold_prompt(prompt_ids)
            except Exception:  # noqa: BLE001 - the request's output stands; its KV is not handed over
                logger.exception("holding the KV of request %s failed", d.request_id)
        deliver = self._deliver.get(d.request_id)
        if deliver is not None:
            deliver(d if d.error is None else RequestFailedError(d.error))

    def _hold_prompt(self, prompt_ids: list[int]) -> KVHold | None:
        """Hold a finished prompt's cached blocks (None when none are cached)."""
        replica = self._replica
        hold = replica.hold_prefix(prompt_ids)
        if hold.num_blocks:
            return hold
        replica.release_hold(hold)
        return None

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
                        self._hold_kv.pop(rid, None)
                    if self.on_step is not None:
                        self.on_step(time.perf_counter() - t0)
                elif self.on_idle is not None:
                    self.on_idle()
                self.last_step_at = time.monotonic()
        except BaseException as e:  # the loop died: fail every waiting stream loudly
            logger.exception("engine loop failed")
            self.fatal_error = e
            for deliver in self._deliver.values():
                deliver(EngineDeadError(f"engine loop failed: {e!r}"))
            self._deliver.clear()
            self._hold_kv.clear()
            if self.on_fatal is not None:
                self.on_fatal(e)
            return
        for rid in list(self._deliver):
            for d in engine.abort(rid):
                self._send(d)
        self._deliver.clear()
