"""Builds the aiohttp application around a running engine (any `EngineClient`).

The app does not own the engine: whoever started the engine shuts it down after the app's
cleanup (`server.cli` for `jaxserve serve`; fixtures in tests).

Shutdown (aiohttp's order: sites stop accepting, idle keep-alive connections close, then
`on_shutdown`, then in-flight handlers get `FINAL_WRITE_SECONDS`, then cleanup): `_drain` lets
the generations in flight run for up to `ServerConfig.shutdown_timeout` seconds, then ends each
one still running with a 503 (a started stream sends it as an error event and `[DONE]`); the
cleanup writes every session and stops the background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from jaxserve.engine_client import EngineClient
from server import (
    openapi,
    routes_conversations,
    routes_embeddings,
    routes_lora,
    routes_messages,
    routes_openai,
    routes_ops,
    routes_responses,
    routes_score,
    routes_sessions,
    routes_tokenize,
)
from server.admission import Admission
from server.auth import ApiKeys, auth_middleware
from server.config import ServerConfig
from server.errors import APIError, error_middleware
from server.metrics import ServerMetrics
from server.model_info import ModelInfo
from server.protocol import BODY_TIMEOUT, Limits
from server.rate_limit import RateLimiter
from server.reply_setup import check_reasoning_parser
from server.response_store import ResponseStore
from server.session_files import SessionFiles
from server.session_kv import SessionKV
from server.sessions import SessionStore
from server.state import STATE, ServerState

logger = logging.getLogger(__name__)

FINAL_WRITE_SECONDS = 5.0  # after the drain: for the stopped streams to send their last events
DRAIN_POLL_SECONDS = 0.05


def build_app(engine: EngineClient, config: ServerConfig) -> web.Application:
    """The server for `engine` (already started and warmed up)."""
    info = ModelInfo.from_engine(engine.info, config.served_model_name, config.chat_template)
    check_reasoning_parser(config.reasoning_parser, info.template)
    keys = ApiKeys(config.api_keys)
    files = SessionFiles(config.session_dir) if config.session_dir is not None else None
    sessions = SessionStore(config.max_sessions_per_key, config.session_ttl, files, config.response_ttl)
    session_kv = SessionKV(engine, sessions, info.name)
    admission = Admission(info.max_num_seqs, config.max_waiting_seqs, config.max_queue_wait, engine.running_capacity)
    metrics = ServerMetrics()
    metrics.queue_depth.set_function(admission.queue_depth)
    state = ServerState(
        engine=engine,
        config=config,
        info=info,
        keys=keys,
        limiter=RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm),
        admission=admission,
        metrics=metrics,
        sessions=sessions,
        session_kv=session_kv,
        responses=ResponseStore(sessions, session_kv, config.max_stored_responses_per_key),
        limits=Limits(
            max_model_len=info.max_model_len,
            max_tokens_limit=config.max_tokens_limit or info.max_model_len,
            max_n=config.max_n,
        ),
    )
    app = web.Application(middlewares=[error_middleware, auth_middleware(keys)], client_max_size=config.max_body_bytes)
    app[STATE] = state
    app.add_routes(routes_openai.routes)
    app.add_routes(routes_lora.routes)
    app.add_routes(routes_embeddings.routes)
    app.add_routes(routes_score.routes)
    app.add_routes(routes_responses.routes)
    app.add_routes(routes_conversations.routes)
    app.add_routes(routes_messages.routes)
    app.add_routes(routes_sessions.routes)
    app.add_routes(routes_ops.routes)
    app.add_routes(routes_tokenize.routes)
    app.add_routes(openapi.routes)
    app[BODY_TIMEOUT] = config.body_timeout
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_drain)
    return app


async def _drain(app: web.Application) -> None:
    state = app[STATE]
    state.draining = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + state.config.shutdown_timeout
    while state.in_flight() and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_SECONDS)
    left = state.in_flight()
    for generation in left:
        generation.shut_down()
    logger.info("shutdown: drained in %.2f s; %d requests stopped", loop.time() - started, len(left))


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    if state.keys.is_open:
        logger.warning(
            "no API key configured: the server is open to anyone who can reach %s:%d",
            state.config.host,
            state.config.port,
        )
    owns_hook = state.engine.on_step is None  # several apps may share one engine (tests): first wins
    if owns_hook:
        state.engine.on_step = state.metrics.observe_step
    state.adapters.update(await state.engine.lora_adapters() or {})
    loaded = state.sessions.load(state.info.vocab_size)
    if loaded:
        logger.info("restored %d sessions from %s", loaded, state.config.session_dir)
    if state.config.session_pin_blocks_per_key is not None:
        await state.session_kv.set_budget(state.config.session_pin_blocks_per_key)
    expiry = asyncio.create_task(_expire_sessions(state))
    yield
    expiry.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await expiry
    for task in list(state.background):
        task.cancel()
    await asyncio.gather(*state.background, return_exceptions=True)
    state.sessions.save_all()
    await state.session_kv.end_all(state.sessions.all())  # the engine may outlive this app (tests share one)
    if owns_hook:
        state.engine.on_step = None


async def _expire_sessions(state: ServerState) -> None:
    period = min(60.0, state.sessions.ttl / 2, state.sessions.response_ttl / 2)
    while True:
        await asyncio.sleep(period)
        for session in state.sessions.expired():
            logger.info("%s expired (idle)", session.id)
            try:
                state.sessions.remove(session)
            except APIError:
                continue  # its file could not be deleted (logged): the next round tries again
            await state.session_kv.end(session)
