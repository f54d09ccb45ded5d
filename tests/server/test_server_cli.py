"""`jaxserve serve` as a process: warm-up report, serving, and a graceful exit 0 on SIGTERM that
lets the request in flight finish."""

from __future__ import annotations

import http.client
import json

from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from server_harness import MODEL_NAME, send, sse_events


class _Port:
    """Just enough of ServerThread for `send`."""

    def __init__(self, port: int) -> None:
        self.port = port


def test_serve_warms_up_serves_and_exits_0_on_sigterm():
    port = free_port()
    with ChildProcess(
        jaxserve("serve", "--model", MODEL_NAME, "--port", str(port), "--api-key", "k1", *SMALL_ENGINE)
    ) as child:
        child.wait_for("Running on", timeout=240)
        assert child.wait_for("compiling buckets", timeout=1).startswith("compiling buckets: decode batch [4]"), (
            child.output
        )
        assert " s" in child.wait_for("warm-up: ", timeout=1)
        srv = _Port(port)
        assert send(srv, "GET", "/health", key=None).json == {"status": "ok"}
        assert send(srv, "GET", "/v1/models", key=None).status == 401

        # A stream in flight when SIGTERM arrives runs to its end before the process exits.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "stream": True}
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"Authorization": "Bearer k1", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        child.terminate()
        events = sse_events((first + resp.read()).decode())
        conn.close()
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert child.finish(60) == 0
        drained = child.wait_for("shutdown: drained", timeout=1)
        assert drained.endswith("0 requests stopped"), drained
        print(f"\n{drained}")
        assert "server stopped" in child.seen
        assert "Traceback" not in child.output, child.output
