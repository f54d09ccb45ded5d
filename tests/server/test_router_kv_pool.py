"""The shared KV pool across workers: two `jaxserve worker` processes on one Mooncake Store master
(loopback), each behind its own router (so the placement is forced). A prompt computed on worker A
is read from the pool by worker B, which reports it cached and answers the same tokens."""

from __future__ import annotations

import time

import jax
import pytest
from child_process import SMALL_ENGINE, free_port
from router_cluster import load, start_router, start_worker, wait_idle
from server_harness import BLOCK_SIZE, send

from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing

if (why := mooncake_missing()) is not None:
    pytest.skip(why, allow_module_level=True)


def _complete(router, prompt: list[int]) -> dict:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = send(router, "POST", "/v1/completions", body, key=None)
    assert reply.status == 200, reply.text
    return reply.json


def test_a_prefix_computed_on_one_worker_is_read_from_the_pool_by_another(_compilation_cache):
    master = PoolMaster()
    master.start()
    cache_dir = jax.config.jax_compilation_cache_dir
    pool = ["--kv-pool", master.url, "--kv-pool-segment-bytes", str(32 << 20), "--kv-disk-min-load-tokens", "16"]
    ports = [free_port(), free_port()]
    procs = [start_worker(p, [*SMALL_ENGINE, *pool], cache_dir) for p in ports]
    routers = []
    try:
        for proc in procs:
            proc.wait_for("worker listening", timeout=600)
        for port in ports:
            routers.append(start_router([port]))
        for proc, _ in routers:
            proc.wait_for("Running on", timeout=120)
        prompt = [(7 * i) % 200 + 3 for i in range(120)]
        first = _complete(routers[0][1], prompt)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        want = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks; the last prompt token is computed
        deadline = time.monotonic() + 30  # until worker A's write-through reached the pool
        while load(ports[0]).tiers.pool_written_blocks < want // BLOCK_SIZE and time.monotonic() < deadline:
            time.sleep(0.2)
        second = _complete(routers[1][1], prompt)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == want, second["usage"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        tiers = load(ports[1]).tiers
        assert tiers.pool_hit_tokens == want and tiers.pool_loads >= 1
        for port in ports:
            snap = wait_idle(port)
            assert snap.kv.used == 0 and snap.kv_requests == 0
    finally:
        for proc, _ in routers:
            proc.terminate()
        for proc in procs:
            proc.terminate()
        for proc in [*(p for p, _ in routers), *procs]:
            proc.finish(60)
        master.kill()
