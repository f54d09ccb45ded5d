"""KV events to the router: two `jaxserve worker` processes (tiny random model, loopback); router A
over worker 1 alone, router B over both. After worker 1 computed a prompt (sent through A), B,
which never saw that request, sends a prompt sharing its prefix to worker 1, from worker 1's KV
events. (By B's own picture of what it sent, both workers hold nothing and the loads are equal:
the request would go to worker 0.)"""

from __future__ import annotations

import time

import jax
from child_process import SMALL_ENGINE, free_port
from router_cluster import routed, start_router, start_worker, wait_idle
from server_harness import BLOCK_SIZE, send


def _complete(router, prompt: list[int]) -> dict:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    reply = send(router, "POST", "/v1/completions", body, key=None)
    assert reply.status == 200, reply.text
    return reply.json


def test_a_router_places_by_the_workers_kv_events_not_its_history(_compilation_cache):
    cache_dir = jax.config.jax_compilation_cache_dir
    ports = [free_port(), free_port()]
    procs = [start_worker(p, SMALL_ENGINE, cache_dir) for p in ports]
    routers = []
    try:
        for proc in procs:
            proc.wait_for("worker listening", timeout=600)
        routers = [start_router([ports[1]]), start_router(ports, "--health-check-interval", "0.3")]
        for proc, _ in routers:
            proc.wait_for("Running on", timeout=120)
        (_, a), (_, b) = routers
        prompt = [(7 * i) % 200 + 3 for i in range(120)]
        _complete(a, prompt)
        time.sleep(1.0)  # the events reach router B (they stream as they happen; B polls nothing)
        reply = _complete(b, [*prompt[:96], 5, 6, 7, 8])
        assert routed(b) == [0, 1]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 96 // BLOCK_SIZE * BLOCK_SIZE
        other = _complete(b, [9] * 40)  # nothing cached anywhere: by load (equal) to worker 0
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and routed(b) == [1, 1]
        for port in ports:
            assert wait_idle(port).kv.used == 0
    finally:
        for proc in [*(p for p, _ in routers), *procs]:
            proc.terminate()
        for proc in [*(p for p, _ in routers), *procs]:
            proc.finish(60)
