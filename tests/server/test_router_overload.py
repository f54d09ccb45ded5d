"""Admission under overload through `jaxserve router` (one `jaxserve worker`, child processes on
loopback): the router's queue deadline and priorities over the worker's running slots, the
same checks as `serve`'s (test_server_overload.py), and the worker's KV pool all free after."""

from __future__ import annotations

import asyncio

import jax
import pytest
from child_process import SMALL_ENGINE, free_port
from overload_harness import check_four_times_capacity, metric, priority_order
from router_cluster import start_router, start_worker, wait_idle
from server_harness import KEY_A

SLOTS = 4  # SMALL_ENGINE's --max-num-seqs: the router's running slots over one worker
MODEL = "tiny-random"


@pytest.fixture(scope="module")
def worker(_compilation_cache):
    port = free_port()
    proc = start_worker(port, SMALL_ENGINE, jax.config.jax_compilation_cache_dir)
    try:
        proc.wait_for("worker listening", timeout=600)
        yield port
    finally:
        proc.terminate()
        assert proc.finish() == 0, proc.output


def _router(worker_port: int, *flags: str):
    proc, endpoint = start_router([worker_port], "--api-key", KEY_A, "--served-model-name", MODEL, *flags)
    proc.wait_for("Running on", timeout=120)
    return proc, endpoint


def test_four_times_capacity_through_the_router(worker):
    proc, router = _router(worker, "--max-waiting-seqs", "1000", "--max-queue-wait", "0.5")
    with proc:
        check_four_times_capacity(router, MODEL, SLOTS, 1, max_tokens=32, deadline=0.5)
        snap = wait_idle(worker)
        assert not snap.has_unfinished and snap.kv.used == 0
        assert metric(router, "jaxserve_queue_depth") == 0


def test_router_honours_priorities(worker):
    proc, router = _router(worker, "--max-waiting-seqs", "8", "--max-queue-wait", "60")
    with proc:
        finished = asyncio.run(priority_order(router, MODEL, SLOTS, 1, fill_tokens=200))
        assert all(name.startswith("high") for name in finished[:SLOTS]), finished
        snap = wait_idle(worker)
        assert not snap.has_unfinished and snap.kv.used == 0
