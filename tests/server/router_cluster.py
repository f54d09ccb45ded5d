"""Workers and routers as child processes on loopback, for the router tests.

`jaxserve worker` and `jaxserve router` run as users start them; the tests talk to the router
over HTTP and to a worker over its internal gRPC service (`load`), to see its KV pool.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
from child_process import ChildProcess, free_port, jaxserve

from jaxserve.engine_snapshot import EngineSnapshot
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import snapshot_from_json
from server.cluster.worker.worker_pb2_grpc import WorkerStub


class Endpoint:
    """What `server_harness.send` needs of a server: its port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"


def start_worker(port: int, engine_flags: list[str], cache_dir: str, model: str = "tiny-random") -> ChildProcess:
    return ChildProcess(
        jaxserve("worker", "--model", model, "--port", str(port), "--compilation-cache-dir", cache_dir, *engine_flags)
    )


def start_router(worker_ports: list[int], *flags: str) -> tuple[ChildProcess, Endpoint]:
    port = free_port()
    workers = [arg for p in worker_ports for arg in ("--worker", f"127.0.0.1:{p}")]
    return ChildProcess(jaxserve("router", "--port", str(port), *workers, *flags)), Endpoint(port)


@contextlib.contextmanager
def worker_behind_router(
    engine_flags: list[str], cache_dir: str, *router_flags: str, model: str = "tiny-random"
) -> Iterator[tuple[Endpoint, int, ChildProcess]]:
    """One worker and a router over it, both ready: (the router's endpoint, the worker's port, the worker).
    Both are stopped after; the router must not have printed a traceback."""
    port = free_port()
    worker = start_worker(port, engine_flags, cache_dir, model=model)
    router, endpoint = start_router([port], *router_flags)
    with worker, router:
        worker.wait_for("worker listening", timeout=600)
        router.wait_for("Running on", timeout=120)
        yield endpoint, port, worker
        router.terminate()
        worker.terminate()
        router.finish(60)
        worker.finish(60)
    assert "Traceback" not in router.output, router.output


def load(worker_port: int) -> EngineSnapshot:
    """A worker's engine snapshot, from its Load RPC."""
    with grpc.insecure_channel(f"127.0.0.1:{worker_port}") as channel:
        reply = WorkerStub(channel).Load(pb.LoadRequest(), timeout=30)
    return snapshot_from_json(reply.snapshot_json)


def wait_idle(worker_port: int, timeout: float = 30.0) -> EngineSnapshot:
    """The worker's snapshot once nothing runs there and no KV block is held (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = load(worker_port)
        if (not snap.has_unfinished and snap.kv_requests == 0 and snap.kv.used == 0) or time.monotonic() > deadline:
            return snap
        time.sleep(0.05)


def workers(router: Endpoint) -> list[dict[str, Any]]:
    """The router's view of its workers (from /health), in --worker order."""
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())["workers"]
    finally:
        conn.close()


def routed(router: Endpoint) -> list[int]:
    return [w["routed"] for w in workers(router)]


def wait_worker_status(router: Endpoint, index: int, status: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while workers(router)[index]["status"] != status:
        assert time.monotonic() < deadline, f"worker {index} not {status}: {workers(router)}"
        time.sleep(0.1)


class Stream:
    """A streamed completion read event by event (the connection stays open until `close`)."""

    def __init__(self, server: Endpoint, body: dict[str, Any], key: str | None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        self.conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}), headers=headers)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()

    def next_event(self) -> Any:
        """The next `data:` payload (parsed JSON, or "[DONE]"); None at the end of the body.

        Lines are read through the response (its chunked framing decoded), so the body ends at its
        last chunk: reading the raw socket instead would wait out the server's keep-alive timeout
        (75 s) on the connection it keeps open after the response."""
        while True:
            line = self.resp.readline()
            if not line:
                return None
            text = line.decode().strip()
            if text.startswith("data: "):
                payload = text[len("data: ") :]
                return payload if payload == "[DONE]" else json.loads(payload)

    def first_text_event(self) -> Any:
        while True:
            event = self.next_event()
            assert event not in (None, "[DONE]"), "the stream ended before any text"
            if event.get("choices") and event["choices"][0].get("text"):
                return event

    def rest(self) -> list[Any]:
        events = []
        while (event := self.next_event()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        """Disconnect. The response is closed too: a response that will close its connection
        (`Connection: close`) holds the socket, and closing only the connection leaves it open."""
        self.resp.close()
        self.conn.close()
