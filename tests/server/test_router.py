"""`jaxserve router` over two `jaxserve worker` processes (tiny random model, loopback).

Compared with `jaxserve serve`'s stack in this process on the same engine settings: the same
text, tokens, usage and session reuse (greedy, and seeded sampling with n = 2); keys, limits and
the official openai client through the router; embeddings; cache-aware placement and the imbalance
override; abort on disconnect reaching the worker (its pool all free); and a worker killed mid-stream
(its stream resumed on the other, retry of a request not yet streamed, health, the worker taken
back on restart; streams under load: test_router_failover.py).
The workers start once for the module; the kill test comes last.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import openai
import pytest
from child_process import SMALL_ENGINE, free_port, small_engine_kwargs
from router_cluster import Stream, load, routed, start_router, start_worker, wait_idle, wait_worker_status, workers
from server_harness import KEY_A, KEY_B, MODEL_NAME, send, start_server

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine

MAX_LEN = 256


def _engine_config() -> EngineConfig:
    return EngineConfig(**small_engine_kwargs())


def _prompt(seed: int, n: int = 24) -> list[int]:
    """Token ids no other prompt of this module starts with."""
    return random.Random(seed).choices(range(3, 299), k=n)


@pytest.fixture(scope="module")
def cluster(_compilation_cache):
    """Two workers, router A (checks health every 0.3 s) and router B (checks every 10 minutes, and
    routes by load as soon as loads differ), and the one-process server to compare with."""
    cache_dir = jax.config.jax_compilation_cache_dir
    ports = [free_port(), free_port()]
    procs = [start_worker(p, SMALL_ENGINE, cache_dir) for p in ports]  # f32, as the reference engine
    with ThreadPoolExecutor(1) as pool:  # the reference engine compiles while the workers do
        reference = pool.submit(_reference_server)
        for proc in procs:
            proc.wait_for("worker listening", timeout=600)
        ref_server, ref_engine = reference.result()
    router_a, a = start_router(ports, "--api-key", KEY_A, "--api-key", KEY_B, "--health-check-interval", "0.3")
    router_b, b = start_router(
        ports, "--health-check-interval", "600", "--balance-abs-threshold", "0", "--balance-rel-threshold", "1"
    )
    router_a.wait_for("Running on", timeout=120)
    router_b.wait_for("Running on", timeout=120)
    state = dict(ports=ports, procs=procs, a=a, b=b, router_a=router_a, router_b=router_b, ref=ref_server)
    yield state
    for proc in [router_a, router_b, *state["procs"]]:
        proc.terminate()
    for proc in [router_a, router_b, *state["procs"]]:
        proc.finish(60)
    ref_server.stop()
    ref_engine.shutdown()
    assert "Traceback" not in router_a.output + router_b.output, router_a.output + router_b.output


def _reference_server():
    engine = LLMEngine(build_tiny_random(), _engine_config())
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    return start_server(async_engine, api_keys=(KEY_A, KEY_B)), async_engine


def _both(cluster, path, body, key=KEY_A):
    ref = send(cluster["ref"], "POST", path, body, key=key)
    got = send(cluster["a"], "POST", path, body, key=key)
    assert ref.status == got.status == 200, (ref.text, got.text)
    return ref.json, got.json


def _same_choices(ref, got):
    strip = lambda reply: ([{k: v for k, v in c.items()} for c in reply["choices"]], reply["usage"])  # noqa: E731
    assert strip(got) == strip(ref)


def test_router_gives_the_one_process_output(cluster):
    cases = [
        (
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": _prompt(1), "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        ),
        (
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 10, "temperature": 0, "logprobs": 2},
        ),
        (
            "/v1/completions",
            {
                "model": MODEL_NAME,
                "prompt": _prompt(2),
                "max_tokens": 10,
                "temperature": 0.8,
                "seed": 7,
                "n": 2,
                "ignore_eos": True,
            },
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Hi, who are you?"}],
                "max_tokens": 10,
                "temperature": 0,
            },
        ),
    ]
    for path, body in cases:
        ref, got = _both(cluster, path, body)
        _same_choices(ref, got)
    # A stop string taken from the greedy text: the router cuts there as the engine does.
    body = {"model": MODEL_NAME, "prompt": _prompt(3), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = _both(cluster, "/v1/completions", body)[0]["choices"][0]["text"]
    stop = text[5:7]
    for extra in ({"stop": [stop]}, {"stop": [stop], "include_stop_str_in_output": True}):
        ref, got = _both(cluster, "/v1/completions", {**body, **extra})
        assert ref["choices"][0]["finish_reason"] == "stop"
        _same_choices(ref, got)
    for port in cluster["ports"]:
        snap = wait_idle(port)
        assert snap.kv_requests == 0 and snap.kv.used == 0


def test_openai_client_streams_through_the_router(cluster):
    def run(server):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_B, max_retries=0, timeout=120)
        chunks = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Tell me"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        models = [m.id for m in client.models.list()]
        return text, usage, models

    assert run(cluster["a"]) == run(cluster["ref"])


def test_embeddings_through_the_router(cluster):
    body = {"model": MODEL_NAME, "input": ["The quick brown fox", _prompt(5)], "encoding_format": "float"}
    ref, got = _both(cluster, "/v1/embeddings", body)
    assert got["usage"] == ref["usage"]
    for r, g in zip(ref["data"], got["data"]):
        assert g["index"] == r["index"]
        np.testing.assert_allclose(g["embedding"], r["embedding"], atol=1e-5)


def test_a_response_chain_stays_on_the_worker_holding_its_kv(cluster):
    def chain(server):
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
        kw = dict(model=MODEL_NAME, instructions="Be brief.", max_output_tokens=8, temperature=0)
        replies, workers_used = [], []
        for text in ("Hello there, tell me a story!", "And then?", "How does it end?"):
            before = routed(server) if server is cluster["b"] else None
            previous = replies[-1].id if replies else None
            replies.append(client.responses.create(input=text, previous_response_id=previous, **kw))
            if before is not None:
                workers_used.append([x - y for x, y in zip(routed(server), before)].index(1))
        for reply in replies:
            client.responses.delete(reply.id)
        return [(r.output_text, r.usage.input_tokens, r.usage.output_tokens) for r in replies], replies, workers_used

    ref, _, _ = chain(cluster["ref"])
    got, replies, used = chain(cluster["b"])  # router B sends a request to the least loaded worker at once...
    assert got == ref
    assert len(set(used)) == 1  # ...but a chain goes where its KV is
    assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in replies[1:])
    deadline = time.monotonic() + 10  # the deletes unpin the chain's KV on its worker
    while any(load(port).kv.pinned for port in cluster["ports"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for port in cluster["ports"]:
        snap = wait_idle(port)
        assert snap.kv_requests == 0 and snap.kv.used == 0 and snap.kv.pinned == 0


def test_sessions_keys_and_limits_through_the_router(cluster):
    def session_flow(server):
        sid = send(server, "POST", "/v1/sessions", {"system": "Be brief.", "temperature": 0, "max_tokens": 8}).json[
            "id"
        ]
        replies = [send(server, "POST", f"/v1/sessions/{sid}/messages", {"content": c}) for c in ("One?", "Two?")]
        assert all(r.status == 200 for r in replies), [r.text for r in replies]
        other = send(server, "GET", f"/v1/sessions/{sid}", key=KEY_B).status  # another key's session
        assert send(server, "DELETE", f"/v1/sessions/{sid}").status == 200
        return [(r.json["choices"][0]["message"]["content"], r.json["usage"]) for r in replies], other

    ref, got = session_flow(cluster["ref"]), session_flow(cluster["a"])
    assert got == ref
    assert got[0][1][1]["prompt_tokens_details"]["cached_tokens"] > 0  # the second turn reused the first's KV
    assert got[1] == 404
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4}
    assert send(cluster["a"], "POST", "/v1/completions", body, key=None).status == 401
    assert send(cluster["a"], "POST", "/v1/completions", body, key="wrong").status == 401
    too_long = send(cluster["a"], "POST", "/v1/completions", {**body, "prompt": _prompt(4, MAX_LEN)})
    assert too_long.status == 400 and too_long.json["error"]["code"] == "context_length_exceeded", too_long.text
    assert send(cluster["a"], "POST", "/v1/completions", {**body, "max_tokens": MAX_LEN + 1}).status == 400


def _long(prompt, max_tokens=200):
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _went_to(router, body) -> int:
    """The worker a one-sequence request was placed on."""
    before = routed(router)
    assert send(router, "POST", "/v1/completions", body, key=KEY_A).status == 200
    return [x - y for x, y in zip(routed(router), before)].index(1)


def test_cache_aware_routing_and_the_imbalance_override(cluster):
    shared = _prompt(10, 64)
    for router, seed in ((cluster["a"], 11), (cluster["b"], 12)):
        assert _went_to(router, _long(shared, 2)) == 0  # idle workers, no match: the tie goes to the first
        busy = Stream(router, _long(_prompt(seed)), KEY_A)  # no match either: worker 0 again, now busier
        busy.first_text_event()
        assert [w["in_flight"] for w in workers(router)] == [1, 0]
        went = _went_to(router, _long(shared + [5, 6, 7], 2))
        if router is cluster["a"]:
            assert went == 0  # 1 sequence apart is below 64 and 1.5x: the worker holding the prefix
            assert _went_to(router, _long(_prompt(seed + 100), 2)) == 1  # no match: the least loaded
        else:
            assert went == 1  # router B's thresholds (0, 1x): any imbalance sends it to the least loaded
        busy.close()  # (the disconnect aborts it)


def test_abort_on_disconnect_reaches_the_worker(cluster):
    a = cluster["a"]
    before_routed = routed(a)
    generated_before = [load(p).generated_tokens for p in cluster["ports"]]
    stream = Stream(a, _long(_prompt(20), MAX_LEN - 30), KEY_A)
    stream.first_text_event()
    stream.close()  # the client goes away
    index = [x - y for x, y in zip(routed(a), before_routed)].index(1)
    port = cluster["ports"][index]
    snap = wait_idle(port)
    assert not snap.has_unfinished and snap.kv_requests == 0 and snap.kv.used == 0, snap
    assert snap.kv.free + snap.kv.cached_idle == snap.kv.num_blocks
    assert snap.generated_tokens - generated_before[index] < MAX_LEN - 30 - 20  # stopped early, not run out


def test_a_killed_worker_has_its_stream_resumed_and_is_taken_back(cluster):
    a, b, ports = cluster["a"], cluster["b"], cluster["ports"]
    # Router B has not noticed yet (it checks every 10 minutes): its next request goes to the dead
    # worker first, fails before streaming anything, and is retried on the other.
    before = routed(a)
    stream = Stream(a, _long(_prompt(30)), KEY_A)
    stream.first_text_event()
    victim = [x - y for x, y in zip(routed(a), before)].index(1)
    cluster["procs"][victim].proc.kill()  # SIGKILL mid-stream: the stream is resumed on the other worker
    events = stream.rest()
    stream.close()
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert events[-1] == "[DONE]"
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["length"]
    cluster["router_a"].wait_for("resuming it on", timeout=10)
    wait_worker_status(a, victim, "down", timeout=10)
    reply = send(a, "POST", "/v1/completions", _long(_prompt(31), 4), key=KEY_A)
    assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 4
    assert workers(a)[victim]["status"] == "down"
    assert victim == 0  # an idle tie goes to the first worker
    assert workers(b)[0]["status"] == "up"  # router B has not checked since it started...
    reply = send(b, "POST", "/v1/completions", _long(_prompt(32), 4), key=None)
    assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 4, reply.text
    cluster["router_b"].wait_for("retrying on", timeout=10)  # ...so it tried worker 0 first
    # The worker comes back on its port: router A takes it back, and an idle tie goes to it again.
    cluster["procs"][victim] = start_worker(ports[victim], SMALL_ENGINE, jax.config.jax_compilation_cache_dir)
    cluster["procs"][victim].wait_for("worker listening", timeout=600)
    wait_worker_status(a, victim, "up", timeout=30)
    assert _went_to(a, _long(_prompt(33), 4)) == 0
    assert send(a, "GET", "/health", key=None).json["status"] == "ok"
