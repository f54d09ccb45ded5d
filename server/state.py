"""What every route handler shares: the engine, the settings and the server's bookkeeping."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from jaxserve.engine_client import EngineClient
from server.admission import Admission
from server.auth import OWNER_KEY, ApiKeys
from server.config import ServerConfig
from server.errors import APIError
from server.generation import EngineRequest, Generation
from server.metrics import ServerMetrics
from server.model_info import ModelInfo
from server.protocol import Limits, check_model
from server.rate_limit import RateLimiter
from server.response_store import ResponseStore
from server.session_kv import SessionKV
from server.sessions import SessionStore

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    info: ModelInfo
    keys: ApiKeys
    limiter: RateLimiter
    admission: Admission
    metrics: ServerMetrics
    sessions: SessionStore
    session_kv: SessionKV
    responses: ResponseStore
    limits: Limits
    # LoRA adapters served as models (name -> directory): read from the engine at start-up, then
    # changed by the load/unload routes (server/routes_lora.py), so a request's model is checked
    # without a trip to the engine thread.
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    background: set[asyncio.Task] = dataclasses.field(default_factory=set)  # fire-and-forget tasks
    draining: bool = False  # shutting down: no new generation starts
    generations: weakref.WeakSet[Generation] = dataclasses.field(default_factory=weakref.WeakSet)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background (session bookkeeping after a reply); failures are logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def model_for(self, body: dict[str, Any]) -> tuple[ModelInfo, str | None]:
        """The model a generation request names (404 if none such): its info as responses show
        it, and the LoRA adapter to run (None: the base model)."""
        model = check_model(body, self.info.name, self.adapters)
        if self.info.encoder is not None:
            kind, routes = (
                ("a cross-encoder", "/v1/score and /v1/rerank")
                if self.info.encoder.is_cross_encoder
                else ("an embedding model", "/v1/embeddings, /v1/score and /v1/rerank")
            )
            raise APIError(
                400,
                f"{model} is {kind} (encoder-only): it serves {routes}, and generates no text",
                code="model_not_generative",
            )
        if model == self.info.name:
            return self.info, None
        return dataclasses.replace(self.info, name=model), model

    def generation(
        self, request: web.Request, requests: list[EngineRequest], endpoint: str, arrival: float | None = None
    ) -> Generation:
        return self.new_generation(request[OWNER_KEY], requests, endpoint, arrival)

    def new_generation(
        self, owner: str, requests: list[EngineRequest], endpoint: str, arrival: float | None = None
    ) -> Generation:
        """A generation for `owner`, tracked so that shutdown can drain it (503 once draining)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        generation = Generation(
            self.engine,
            requests,
            owner=owner,
            endpoint=endpoint,
            metrics=self.metrics,
            limiter=self.limiter,
            timeout=self.config.request_timeout,
            arrival=arrival if arrival is not None else time.perf_counter(),
            slots=self.admission.slots,
        )
        self.generations.add(generation)
        return generation

    def in_flight(self) -> list[Generation]:
        return [g for g in self.generations if not g.done]


STATE = web.AppKey("jaxserve_state", ServerState)
