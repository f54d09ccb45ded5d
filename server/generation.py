"""Runs the engine requests of one API call and merges their deltas, with timeout and accounting.

A call may hold several engine requests (a completions request with a list of prompts); each
gives `n` choices, numbered `first_choice + delta.index`. Leaving the iteration early (client
gone, handler cancelled, timeout) aborts every request still running in the engine. When the
iteration ends, however it ends, the call's tokens are counted in the metrics and charged to the
key's token rate limit. `shut_down` (the server stopping) ends the iteration with a 503, which a
stream that has started sends as its last event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from jaxserve.engine_client import EngineClient, EngineDeadError, RequestFailedError, UnknownAdapterError
from jaxserve.image_prompt import MultimodalPrompt, PromptImage
from jaxserve.outputs import Delta, Usage
from jaxserve.sampling_params import SamplingParams
from server.errors import APIError
from server.metrics import ServerMetrics
from server.openai_bodies import UsageCount
from server.rate_limit import RateLimiter
from server.run_slots import RunSlots, Ticket

_DONE = object()
_SHUT_DOWN = object()


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_choice: int = 0
    session_id: str | None = None  # keeps a session's turns on the replica holding its KV
    images: tuple[PromptImage, ...] = ()  # the rows of its images among `prompt_ids`


@dataclasses.dataclass
class _ChoiceTiming:
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        requests: list[EngineRequest],
        *,
        owner: str,
        endpoint: str,
        metrics: ServerMetrics,
        limiter: RateLimiter,
        timeout: float | None,
        arrival: float | None = None,
        slots: RunSlots | None = None,
    ) -> None:
        self._engine = engine
        self._slots = slots  # the server's queue with a deadline (None: straight to the engine)
        self._ticket: Ticket | None = None
        self._shut_down = False
        self.requests = requests
        self._owner = owner
        self._endpoint = endpoint
        self._metrics = metrics
        self._limiter = limiter
        self._timeout = timeout or None
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_at: float | None = None
        self.usage = UsageCount(prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        self.outcome = "ok"
        self._timing: dict[int, _ChoiceTiming] = {}
        self._cached: dict[str, int] = {}
        self._cancelled = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self.done = False  # the iteration has ended (or never will start: see `shut_down`)

    @property
    def num_choices(self) -> int:
        return sum(r.params.n for r in self.requests)

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) in arrival order, once the call has running slots (an APIError 503
        when it waited for them past the queue's deadline). Use under `contextlib.aclosing`."""
        await self._wait_for_slots()
        try:
            async with aclosing(self._merged_deltas()) as deltas:
                async for item in deltas:
                    yield item
        finally:
            if self._ticket is not None:
                self._slots.release(self._ticket)

    async def _wait_for_slots(self) -> None:
        """Take running slots from the server's queue (when it has one); a refusal or the client
        leaving while it waits is accounted here, since the engine never sees the call."""
        if self._slots is None or self._cancelled:
            return
        priority = min(r.params.priority for r in self.requests)
        self._ticket = self._slots.take(self.num_choices, priority)
        try:
            if self._shut_down:
                self._slots.withdraw(self._ticket, _shutting_down())
            await self._slots.wait(self._ticket)
        except BaseException as e:  # counted as a request; it generated nothing
            self.outcome = "refused" if isinstance(e, APIError) else "cancelled"
            self._metrics.requests.labels(self._endpoint, self.outcome).inc()
            self.done = True
            raise
        if self._ticket.holding:  # (not when cancelled while it waited)
            self._metrics.queue_wait.observe(self._ticket.waited)

    async def _merged_deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        queue = self._queue
        tasks = [asyncio.create_task(self._pump(r, queue)) for r in self.requests]
        pending = len(tasks)
        deadline = None if self._timeout is None else asyncio.get_running_loop().time() + self._timeout
        try:
            while pending:
                if deadline is None:
                    item = await queue.get()
                else:
                    remaining = deadline - asyncio.get_running_loop().time()
                    try:
                        item = await asyncio.wait_for(queue.get(), max(remaining, 0.0))
                    except TimeoutError:
                        self.outcome = "timeout"
                        raise APIError(
                            504, f"the request did not finish within {self._timeout:g} s", code="request_timeout"
                        ) from None
                if item is _DONE:
                    pending -= 1
                    continue
                if item is _SHUT_DOWN:
                    self.outcome = "error"
                    raise _shutting_down()
                if isinstance(item, BaseException):
                    self.outcome = "error"
                    raise _api_error(item)
                index, delta = item
                self._track(index, delta)
                yield index, delta
        finally:
            if (pending or self._cancelled) and self.outcome == "ok":
                self.outcome = "cancelled"
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:  # aiohttp may cancel the handler again while it waits here (the connection drops)
                self._account()
                self.done = True

    def shut_down(self) -> None:
        """End the iteration now with a 503 (the server is stopping); the requests are aborted."""
        self._shut_down = True
        if self._ticket is not None:
            self._slots.withdraw(self._ticket, _shutting_down())
        self._queue.put_nowait(_SHUT_DOWN)

    def cancel(self) -> None:
        """Abort every request of the call: each choice ends with finish_reason "abort" and
        keeps what it generated so far."""
        self._cancelled = True
        if self._ticket is not None:  # still queued: it ends now, without running
            self._slots.withdraw(self._ticket, None)
        for req in self.requests:
            self._engine.abort(req.request_id)

    async def _pump(self, req: EngineRequest, queue: asyncio.Queue) -> None:
        if self._cancelled:  # cancelled before it reached the engine
            for i in range(req.params.n):
                usage = Usage(len(req.prompt_ids), 0)
                queue.put_nowait((req.first_choice + i, Delta(req.request_id, i, "", [], None, "abort", usage)))
            queue.put_nowait(_DONE)
            return
        try:
            prompt = MultimodalPrompt(req.prompt_ids, req.images) if req.images else req.prompt_ids
            stream = self._engine.generate(req.request_id, prompt, req.params, req.session_id)
            async with aclosing(stream):
                async for delta in stream:
                    queue.put_nowait((req.first_choice + delta.index, delta))
        except Exception as e:  # handed to the consumer, which turns it into an API error
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    def _track(self, index: int, delta: Delta) -> None:
        now = time.perf_counter()
        n = len(delta.token_ids)
        self.usage.completion_tokens += n
        if n:
            timing = self._timing.setdefault(index, _ChoiceTiming(first=now))
            timing.last = now
            timing.tokens += n
            if self.first_token_at is None:
                self.first_token_at = now
        if delta.usage is not None:
            cached = max(self._cached.get(delta.request_id, 0), delta.usage.cached_tokens)
            self._cached[delta.request_id] = cached
            self.usage.cached_tokens = sum(self._cached.values())

    def _account(self) -> None:
        m = self._metrics
        now = time.perf_counter()
        m.requests.labels(self._endpoint, self.outcome).inc()
        m.prompt_tokens.inc(self.usage.prompt_tokens)
        m.generation_tokens.inc(self.usage.completion_tokens)
        if self.first_token_at is not None:
            m.ttft.observe(self.first_token_at - self.arrival)
            m.e2e.observe(now - self.arrival)
        for timing in self._timing.values():
            if timing.tokens > 1:
                m.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))
        self._limiter.charge_tokens(self._owner, self.usage.completion_tokens)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; the request was stopped", code="server_shutting_down")


def _api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_unavailable")
    if isinstance(error, UnknownAdapterError):
        return APIError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    if isinstance(error, RequestFailedError):
        return APIError(500, "the engine failed while generating this request", code="internal_error")
    return APIError(500, "the engine failed while generating")
