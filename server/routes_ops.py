"""`/health` (is the engine loop alive) and `/metrics` (Prometheus text format). No key needed."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jaxserve.engine_client import EngineClient
from server.state import STATE

routes = web.RouteTableDef()

STUCK_AFTER_SECONDS = 120.0  # a loop that has not come round for this long is reported unhealthy


def engine_problem(engine: EngineClient) -> str | None:
    """Why the engine cannot serve (stopped, or stuck), or None when it is healthy."""
    if not engine.is_alive:
        return "stopped"
    since = time.monotonic() - engine.last_step_at
    if since > STUCK_AFTER_SECONDS:
        return f"no loop iteration for {since:.0f} s"
    return None


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    problem = engine_problem(engine)
    details = engine.health_details()  # a router's workers, each up or down
    if problem is not None:
        return web.json_response({"status": "error", "engine": problem, **details}, status=503)
    return web.json_response({"status": "ok", **details})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        snapshot = await state.engine.snapshot()
    except TimeoutError:
        snapshot = None
    body = state.metrics.render(snapshot, state.engine.is_alive)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
