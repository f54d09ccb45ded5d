"""The `Worker` gRPC service of one engine, listening: what `jaxserve worker` runs, and what each
replica group's leader of a multi-process `jaxserve serve` runs for process 0's router."""

from __future__ import annotations

import grpc

from jaxserve.engine_client import KVTransferEngine
from server.cluster.worker.kv_handoff import MAX_MESSAGE_BYTES, KVHandoff
from server.cluster.worker.service import WorkerServicer
from server.cluster.worker.worker_pb2_grpc import add_WorkerServicer_to_server
from server.tls import ClusterTLS, add_listening_port


class WorkerListener:
    """Serves `engine` as a worker on `host`:`port` (0: a free port, read `port` after `start`).
    `handoff` (prefill/decode disaggregation) is started and closed with the service. With `tls`
    it serves mutual TLS only: a client without a certificate signed by its CA is refused."""

    def __init__(
        self,
        engine: KVTransferEngine,
        host: str,
        port: int,
        role: str = "both",
        handoff: KVHandoff | None = None,
        tls: ClusterTLS | None = None,
    ) -> None:
        self.engine = engine
        self._tls = tls
        self._role = role
        self._handoff = handoff
        self.host = host
        self.port = port
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        """HOST:PORT as a router's --worker takes it."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Listen (on the running event loop)."""
        self._server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES + (1 << 20))])
        if self._handoff is not None:
            self._handoff.start()
        add_WorkerServicer_to_server(WorkerServicer(self.engine, self._role, self._handoff), self._server)
        bind = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.port = add_listening_port(self._server, bind, self._tls)
        await self._server.start()

    async def stop(self, grace_s: float) -> None:
        """Stop listening; calls in flight get `grace_s` seconds to finish."""
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._handoff is not None:
            await self._handoff.close()
