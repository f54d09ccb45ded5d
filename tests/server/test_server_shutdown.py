"""Graceful shutdown of `jaxserve serve` (a real child process) and connection timeouts.

SIGTERM: no new work, in-flight requests get `--shutdown-timeout` seconds, then each stream
still running ends with an error event and `[DONE]`; sessions are on disk (a cut reply keeps its
partial text), the engine thread stops before the event loop closes, and the exit status is 0.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from server_harness import KEY_A, MODEL_NAME, send, sse_events, start_server


class _Port:
    """Just enough of ServerThread for `send`."""

    def __init__(self, port: int) -> None:
        self.port = port


def _open_stream(port: int, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Authorization": "Bearer k1", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _serve(port: int, session_dir, *extra: str) -> ChildProcess:
    return ChildProcess(
        jaxserve(
            "serve",
            "--model",
            MODEL_NAME,
            "--port",
            str(port),
            "--api-key",
            "k1",
            "--session-dir",
            str(session_dir),
            *SMALL_ENGINE,
            *extra,
        )
    )


def test_sigterm_past_the_timeout_ends_streams_with_an_error_then_done_and_keeps_sessions(tmp_path):
    port = free_port()
    with _serve(port, tmp_path, "--shutdown-timeout", "0") as child:
        child.wait_for("Running on", timeout=240)
        srv = _Port(port)
        session = send(srv, "POST", "/v1/sessions", {"system": "Be brief."}, key="k1").json["id"]
        long = {"max_tokens": 200, "ignore_eos": True, "stream": True}
        streams = [
            _open_stream(port, f"/v1/sessions/{session}/messages", {"content": "Tell me a story", **long}),
            _open_stream(port, "/v1/completions", {"model": MODEL_NAME, "prompt": "Hello", "n": 2, **long}),
        ]
        firsts = [resp.readline() for _, resp in streams]
        assert all(line.startswith(b"data: ") for line in firsts)
        t0 = time.monotonic()
        child.terminate()
        for (conn, resp), first in zip(streams, firsts):
            events = sse_events((first + resp.read()).decode())
            conn.close()
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
        assert child.finish(60) == 0
        drain = time.monotonic() - t0
        drained = child.wait_for("shutdown: drained", timeout=1)
        assert drained.endswith("2 requests stopped"), drained
        print(f"\nshutdown with 2 streams cut (timeout 0): exit {drain:.2f} s after SIGTERM; {drained}")
        assert "server stopped" in child.seen
        for bad in ("Traceback", "Event loop is closed", "engine loop failed"):
            assert bad not in child.output, child.output

    # The cut reply was saved with what it had generated; a restart serves it.
    with _serve(port, tmp_path) as child:
        child.wait_for("Running on", timeout=240)
        assert "restored 1 sessions" in child.output
        messages = send(_Port(port), "GET", f"/v1/sessions/{session}", key="k1").json["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert messages[2]["content"]
        child.terminate()
        assert child.finish(60) == 0


def _raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while chunk := sock.recv(65536):
            del chunk  # the rest of a response; keep reading until EOF
        return True
    except TimeoutError:
        return False


def test_idle_keepalive_stalled_headers_and_stalled_bodies_are_closed(async_engine):
    srv = start_server(async_engine, api_keys=(KEY_A,), keepalive_timeout=0.5, body_timeout=0.5)
    try:
        sock = _raw_connection(srv.port)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_by_server(sock, within=5.0)  # idle past keepalive_timeout
        sock.close()

        for stalled in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):  # silent; headers never finished
            sock = _raw_connection(srv.port)
            sock.sendall(stalled)
            assert _closed_by_server(sock, within=5.0)
            sock.close()

        sock = _raw_connection(srv.port)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY_A.encode()
            + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt":'
        )
        sock.settimeout(5.0)
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"request_timeout" in reply
        assert _closed_by_server(sock, within=5.0)
        sock.close()
        assert send(srv, "GET", "/health", key=None).status == 200
    finally:
        srv.stop()
