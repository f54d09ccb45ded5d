"""Serves the gRPC API on an aiohttp app's event loop, for as long as the app runs.

One process and one loop serve both APIs, with the app's `ServerState` (engine, keys, limits,
metrics). The gRPC server starts with the app (a `cleanup_ctx`, after the app's own set-up) and
begins its graceful stop first thing when the app shuts down (it accepts no new call), so
in-flight gRPC calls drain with the HTTP ones: the app's drain ends every call still running
after `ServerConfig.shutdown_timeout` seconds with UNAVAILABLE, within the stop's grace.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

from server.app import FINAL_WRITE_SECONDS
from server.grpc_api.jaxserve_pb2_grpc import add_JaxServeServicer_to_server
from server.grpc_api.malformed import MalformedRequestInterceptor
from server.grpc_api.service import JaxServeServicer
from server.state import STATE
from server.tls import public_grpc_credentials


class GrpcServer:
    def __init__(self, host: str, port: int) -> None:
        """Listen on host:port once attached to an app and started; port 0 takes a free port."""
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port: int | None = None  # the bound port, once started
        self._stopping: asyncio.Task | None = None
        self._server: grpc.aio.Server | None = None

    def attach(self, app: web.Application) -> GrpcServer:
        app.cleanup_ctx.append(self._lifecycle)
        app.on_shutdown.insert(0, self._begin_stop)  # before the app's drain, which waits
        return self

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", state.config.max_body_bytes)],
            interceptors=[MalformedRequestInterceptor()],
        )
        add_JaxServeServicer_to_server(JaxServeServicer(state), server)
        config = state.config
        credentials = public_grpc_credentials(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
        if credentials is None:
            self.port = server.add_insecure_port(self.address)
        else:  # TLS, as the HTTP side serves HTTPS
            self.port = server.add_secure_port(self.address, credentials)
        await server.start()
        self._server = server
        # Printed, as aiohttp prints "Running on ...": the start-up lines `jaxserve serve` shows.
        print(f"gRPC service listening on {self.address.rsplit(':', 1)[0]}:{self.port}", flush=True)
        yield
        await self._begin_stop(app)
        if self._stopping is not None:
            await self._stopping

    async def _begin_stop(self, app: web.Application) -> None:
        """Start the one graceful stop (on the app's shutdown, so that both APIs drain at once)."""
        if self._stopping is None and self._server is not None:
            grace = app[STATE].config.shutdown_timeout + FINAL_WRITE_SECONDS
            self._stopping = asyncio.create_task(self._server.stop(grace))
