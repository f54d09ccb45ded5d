"""`jaxserve serve` as a process: warm-up report, serving, and a graceful exit 0 on SIGTERM that
lets the request in flight finish."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from server_harness import MODEL_NAME, send, sse_events

SMALL_ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "256", "--block-size", "8",
                "--num-blocks", "128", "--decode-batch-buckets", "4", "--prefill-token-buckets", "32",
                "--prefill-seq-buckets", "4", "--block-table-buckets", "32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Port:
    """Just enough of ServerThread for `send`."""

    def __init__(self, port: int) -> None:
        self.port = port


def _lines(proc: subprocess.Popen) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_for(lines: queue.Queue, seen: list[str], needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(needle in line for line in seen):
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert line is not None, "server exited early:\n" + "\n".join(seen)
        seen.append(line)


def test_serve_warms_up_serves_and_exits_0_on_sigterm():
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", MODEL_NAME, "--port", str(port),
               "--api-key", "k1", *SMALL_ENGINE]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: list[str] = []
    try:
        lines = _lines(proc)
        _wait_for(lines, seen, "Running on", timeout=240)
        assert any(line.startswith("compiling buckets: decode batch [4]") for line in seen), seen
        assert any(line.startswith("warm-up: ") and " s" in line for line in seen), seen
        srv = _Port(port)
        assert send(srv, "GET", "/health", key=None).json == {"status": "ok"}
        assert send(srv, "GET", "/v1/models", key=None).status == 401

        # A stream in flight when SIGTERM arrives runs to its end before the process exits.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 150, "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Authorization": "Bearer k1", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        events = sse_events((first + resp.read()).decode())
        conn.close()
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert proc.wait(60) == 0
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
        assert "server stopped" in seen
        assert not any("Traceback" in line for line in seen), "\n".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
