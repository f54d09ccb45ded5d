"""A worker SIGKILLed under streaming load through `jaxserve router` (tiny random model, two
`jaxserve worker` processes on loopback, real HTTP streams).

Every stream, greedy, seeded or unseeded, runs when the worker dies: each one still ends with
`[DONE]` after its full text, one finish reason and its usage (the original prompt and every
output token, counted once), and no error event; the streams the dead worker was generating are
resumed on the other worker (the router says so), and the greedy and seeded ones equal the same
requests run uninterrupted before the kill. The surviving worker's KV pool is free afterwards.
(A disaggregated decode worker dying mid-stream: tests/server/test_router_disagg.py.)
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import pytest
from child_process import SMALL_ENGINE, free_port
from router_cluster import Stream, start_router, start_worker, wait_idle, workers
from server_harness import MODEL_NAME, send

PROMPT_LEN = 16
MAX_TOKENS = 200  # within SMALL_ENGINE's --max-model-len 256: long enough to be mid-stream at the kill
STREAMS = 8  # SMALL_ENGINE runs 4 sequences per worker: every stream is generating at the kill


def _body(i: int) -> dict[str, Any]:
    """Greedy, seeded or unseeded sampling, by i % 3 (streamed with usage: `_streamed`)."""
    prompt = random.Random(1000 + i).choices(range(3, 299), k=PROMPT_LEN)
    sampling = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 50 + i}, {"temperature": 0.9}][i % 3]
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}


def _streamed(i: int) -> dict[str, Any]:
    return {**_body(i), "stream_options": {"include_usage": True}}


def _reproducible(i: int) -> bool:
    return i % 3 != 2


@pytest.fixture(scope="module")
def cluster(_compilation_cache):
    cache_dir = jax.config.jax_compilation_cache_dir
    ports = [free_port(), free_port()]
    procs = [start_worker(p, SMALL_ENGINE, cache_dir) for p in ports]
    for proc in procs:
        proc.wait_for("worker listening", timeout=900)
    router, endpoint = start_router(ports, "--health-check-interval", "0.3")
    router.wait_for("Running on", timeout=120)
    yield dict(ports=ports, procs=procs, router=router, endpoint=endpoint)
    for proc in [router, *procs]:
        proc.terminate()
    for proc in [router, *procs]:
        proc.finish(60)
    assert "Traceback" not in router.output, router.output


def _read(stream: Stream, first: dict[str, Any]) -> tuple[str, list[Any]]:
    """The stream's whole text and every event after the first, to its end."""
    events = stream.rest()
    stream.close()
    text = first["choices"][0]["text"] + "".join(
        e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")
    )
    return text, [first, *events]


@pytest.mark.slow  # ~35 s; test_router.py kills a worker mid-stream and resumes its stream in CI
def test_a_worker_killed_mid_stream_has_its_streams_resumed_on_the_other(cluster):
    endpoint = cluster["endpoint"]
    uninterrupted = {}
    for i in range(STREAMS):
        if _reproducible(i):
            reply = send(endpoint, "POST", "/v1/completions", _body(i), key=None)
            assert reply.status == 200, reply.text
            uninterrupted[i] = reply.json["choices"][0]["text"]
    streams = [Stream(endpoint, _streamed(i), None) for i in range(STREAMS)]
    firsts = [s.first_text_event() for s in streams]
    in_flight = [w["in_flight"] for w in workers(endpoint)]
    victim = max(range(2), key=in_flight.__getitem__)
    assert in_flight[victim] > 0, in_flight
    cluster["procs"][victim].proc.kill()  # SIGKILL, with its streams mid-way
    with ThreadPoolExecutor(STREAMS) as pool:
        results = list(pool.map(_read, streams, firsts))
    for i, (text, events) in enumerate(results):
        assert not [e for e in events if isinstance(e, dict) and "error" in e], (i, events)
        assert events[-1] == "[DONE]", (i, events[-3:])
        reasons = [
            c["finish_reason"]
            for e in events
            if isinstance(e, dict)
            for c in e.get("choices", ())
            if c.get("finish_reason")
        ]
        assert reasons == ["length"], (i, reasons)
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert len(usage) == 1, (i, usage)
        assert (usage[0]["prompt_tokens"], usage[0]["completion_tokens"]) == (PROMPT_LEN, MAX_TOKENS), (i, usage)
        if _reproducible(i):
            assert text == uninterrupted[i], i
    cluster["router"].wait_for("resuming it on", timeout=10)
    survivor = cluster["ports"][1 - victim]
    snap = wait_idle(survivor)
    assert not snap.has_unfinished and snap.kv_requests == 0 and snap.kv.used == 0, snap
