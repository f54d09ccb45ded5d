"""A session survives a restart with its KV: `jaxserve serve` with --session-dir and --kv-disk-dir,
a conversation, SIGTERM (the clean shutdown writes the prefix cache to disk), a new server on the
same directories, and the next turn's prompt is served from the disk tier
(`usage.prompt_tokens_details.cached_tokens`). So does a chain of stored responses
(`previous_response_id`). And two servers running at once on one --kv-disk-dir: the second hits
the blocks the first computed."""

from __future__ import annotations

import time

import openai
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from server_harness import BLOCK_SIZE, MODEL_NAME, send

KEY = "k1"


class _Port:
    def __init__(self, port: int) -> None:
        self.port = port


def _serve(port: int, session_dir, kv_dir, *extra: str) -> ChildProcess:
    return ChildProcess(
        jaxserve(
            "serve",
            "--model",
            MODEL_NAME,
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--session-dir",
            str(session_dir),
            "--kv-disk-dir",
            str(kv_dir),
            "--kv-disk-bytes",
            str(64 << 20),
            "--kv-disk-min-load-tokens",
            "16",
            *extra,
            *SMALL_ENGINE,
        )
    )


def _ok(reply):
    assert reply.status == 200, reply.text
    return reply.json


def _turn(port: int, sid: str, content: str) -> dict:
    return _ok(
        send(
            _Port(port),
            "POST",
            f"/v1/sessions/{sid}/messages",
            {"role": "user", "content": content, "max_tokens": 12, "temperature": 0},
            key=KEY,
        )
    )


def _metric(port: int, name: str) -> float:
    for line in send(_Port(port), "GET", "/metrics", key=None).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_a_session_resumes_with_its_kv_from_disk_after_a_restart(tmp_path):
    sessions, kv = tmp_path / "sessions", tmp_path / "kv"
    port = free_port()
    # Blocks are written only once hit 1000 times, i.e. never while it runs: the clean shutdown writes them.
    with _serve(port, sessions, kv, "--kv-disk-write-through-hits", "1000") as child:
        child.wait_for("Running on", timeout=300)
        sid = _ok(send(_Port(port), "POST", "/v1/sessions", {"system": "You answer in one line."}, key=KEY))["id"]
        for q in (
            "Tell me about the sea and its tides.",
            "And about the moon, please, in some detail?",
            "What links the two of them?",
        ):
            last = _turn(port, sid, q)
        history = last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
        assert _metric(port, 'jaxserve_kv_disk_io_bytes_total{direction="written"}') == 0
        child.terminate()
        assert child.finish(120) == 0, child.output
    assert list(kv.glob("*/*/*.kvb")), "no block was written to disk"
    with _serve(port, sessions, kv) as child:
        child.wait_for("Running on", timeout=300)
        assert "found" in child.wait_for("KV disk tier in", timeout=5)
        reply = _turn(port, sid, "Thanks!")
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE, (cached, history, child.output)
        assert _metric(port, 'jaxserve_kv_tier_hit_tokens_total{tier="disk"}') >= cached
        assert _metric(port, "jaxserve_kv_disk_load_duration_seconds_count") >= 1
        child.terminate()
        assert child.finish(120) == 0


def _complete(port: int, prompt: list[int]) -> dict:
    return _ok(
        send(
            _Port(port),
            "POST",
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            key=KEY,
        )
    )


def test_two_servers_on_one_directory_hit_each_others_blocks(tmp_path):
    prompt = [(7 * i) % 200 + 3 for i in range(120)]
    ports = free_port(), free_port()
    with (
        _serve(ports[0], tmp_path / "s0", tmp_path / "kv") as a,
        _serve(ports[1], tmp_path / "s1", tmp_path / "kv") as b,
    ):
        a.wait_for("Running on", timeout=400)
        b.wait_for("Running on", timeout=400)
        first = _complete(ports[0], prompt)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        want = (len(prompt) - 1) // BLOCK_SIZE
        written, deadline = -1.0, time.monotonic() + 30  # until a's background writes settle
        while time.monotonic() < deadline:
            now = _metric(ports[0], 'jaxserve_kv_disk_io_bytes_total{direction="written"}')
            if now > 0 and now == written:
                break
            written = now
            time.sleep(0.5)
        second = _complete(ports[1], prompt)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (want - 1) * BLOCK_SIZE, second["usage"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        for child in (a, b):
            child.terminate()
            assert child.finish(120) == 0


def test_a_response_chain_continues_after_a_restart_with_its_kv_from_disk(tmp_path):
    sessions, kv = tmp_path / "sessions", tmp_path / "kv"
    port = free_port()
    kw = dict(model=MODEL_NAME, instructions="Answer in one line.", max_output_tokens=12, temperature=0)

    def client() -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)

    with _serve(port, sessions, kv, "--kv-disk-write-through-hits", "1000") as child:
        child.wait_for("Running on", timeout=300)
        first = client().responses.create(input="Tell me about the sea and its tides.", **kw)
        second = client().responses.create(input="And about the moon?", previous_response_id=first.id, **kw)
        assert second.usage.input_tokens_details.cached_tokens > 0
        child.terminate()
        assert child.finish(120) == 0, child.output
    with _serve(port, sessions, kv) as child:
        child.wait_for("Running on", timeout=300)
        third = client().responses.create(input="What links the two?", previous_response_id=second.id, **kw)
        history = second.usage.input_tokens + second.usage.output_tokens
        assert third.usage.input_tokens > history
        cached = third.usage.input_tokens_details.cached_tokens
        assert cached >= (history - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE, (cached, history, child.output)
        assert third.status in ("completed", "incomplete") and third.output_text
        assert client().responses.retrieve(first.id).output_text == first.output_text  # stored across the restart
        assert _metric(port, 'jaxserve_kv_tier_hit_tokens_total{tier="disk"}') >= cached - BLOCK_SIZE
        child.terminate()
        assert child.finish(120) == 0
