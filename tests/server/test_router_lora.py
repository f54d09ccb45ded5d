"""LoRA adapters through the router with two workers (child processes, as users start them): the
workers load adapters from `--lora-modules`; the router lists them with their parent, routes
requests of four adapters and the base model to both workers with transformers + PEFT's greedy
tokens, answers 404 for an unknown model, and loads and unloads an adapter on every worker; the
workers' KV pools are free afterwards. Requests of an adapter go to the worker that holds it; a
worker that restarts gets the adapters loaded through the router at run time; a session of an
adapter runs it on every turn and reuses its KV."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jax
import openai
import pytest
from child_process import free_port
from lora_harness import EXTRA, LORA_ENGINE, TINY_ADAPTERS, reference_runs, write_tiny_adapters
from router_cluster import routed, start_router, start_worker, wait_idle, wait_worker_status
from server_harness import KEY_A, send

from checkpoints.tiny_random import build_tiny_random
from jaxserve.tokenizer import Tokenizer
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.worker_pb2_grpc import WorkerStub

pytestmark = pytest.mark.slow  # two workers and a router start (about a minute on 2 cores)
ENGINE_FLAGS = [
    flag
    for name, value in LORA_ENGINE.items()
    for flag in (
        ["--" + name.replace("_", "-")]
        if value is True
        else ["--" + name.replace("_", "-"), *map(str, value if isinstance(value, tuple) else (value,))]
    )
]


@pytest.fixture(scope="module")
def cluster(_compilation_cache, tmp_path_factory):
    adapters = write_tiny_adapters(tmp_path_factory.mktemp("adapters"))
    modules = [f"{spec.name}={adapters[spec.name]}" for spec in TINY_ADAPTERS]
    ports = [free_port(), free_port()]
    flags = [*ENGINE_FLAGS, "--dtype", "float32", "--lora-modules", *modules]
    procs = [start_worker(p, flags, jax.config.jax_compilation_cache_dir) for p in ports]
    for proc in procs:
        proc.wait_for("worker listening", timeout=600)
    router, endpoint = start_router(
        ports,
        "--api-key",
        KEY_A,
        "--served-model-name",
        "tiny-random",
        "--worker-max-loras",
        str(LORA_ENGINE["max_loras"]),
    )
    router.wait_for("Running on", timeout=120)
    cluster = dict(ports=ports, router=endpoint, adapters=adapters, procs=procs, flags=flags)
    yield cluster
    everyone = [router, *cluster["procs"]]
    for proc in everyone:
        proc.terminate()
    for proc in everyone:
        proc.finish(60)
    assert "Traceback" not in router.output, router.output


def test_adapters_through_the_router_match_peft_on_both_workers(cluster):
    client = openai.OpenAI(base_url=cluster["router"].base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny-random", *(s.name for s in TINY_ADAPTERS)}
    assert cards["attn-r8"].parent == "tiny-random"
    decode = Tokenizer(build_tiny_random().tokenizer_bundle).decode
    runs = reference_runs() * 2

    def run(case: tuple) -> str:
        name, prompt, new_ids = case
        out = client.completions.create(
            model=name or "tiny-random",
            prompt=prompt,
            max_tokens=len(new_ids),
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, runs))
    assert got == [decode(new_ids) for _, _, new_ids in runs]
    assert min(routed(cluster["router"])) > 0  # both workers served
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)

    router = cluster["router"]
    load = {"lora_name": EXTRA.name, "lora_path": str(cluster["adapters"][EXTRA.name])}
    assert send(router, "POST", "/v1/load_lora_adapter", load).status == 200
    bad = {"lora_name": "bad", "lora_path": "/nonexistent"}
    assert send(router, "POST", "/v1/load_lora_adapter", bad).status == 400
    outs = [
        client.completions.create(
            model=EXTRA.name, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for _ in range(4)
    ]
    assert len(set(outs)) == 1  # the same adapter on either worker
    assert send(router, "POST", "/v1/unload_lora_adapter", {"lora_name": EXTRA.name}).status == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=EXTRA.name, prompt="hi", max_tokens=2)
    for port in cluster["ports"]:
        snap = wait_idle(port)
        assert snap.kv.used == 0 and snap.kv_requests == 0


def worker_adapters(port: int) -> dict[str, str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return dict(WorkerStub(channel).ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=30).adapters)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    return (
        client.completions.create(
            model=model, prompt=prompt, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


def test_an_adapter_sticks_to_its_worker_restarts_get_run_time_loads_and_sessions_keep_it(cluster):
    router = cluster["router"]
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
    name = TINY_ADAPTERS[3].name
    load = {"lora_name": EXTRA.name, "lora_path": str(cluster["adapters"][EXTRA.name])}
    assert send(router, "POST", "/v1/load_lora_adapter", load).status == 200
    expected = complete(client, EXTRA.name, [5, 6, 7, 8])
    restarted = cluster["procs"][0]
    restarted.terminate()
    restarted.finish(60)
    wait_worker_status(router, 0, "down")
    before = routed(router)
    complete(client, name, [40, 41, 42])  # worker 1 alone serves: it holds the adapter now
    assert routed(router)[1] == before[1] + 1
    cluster["procs"][0] = start_worker(cluster["ports"][0], cluster["flags"], jax.config.jax_compilation_cache_dir)
    cluster["procs"][0].wait_for("worker listening", timeout=600)
    wait_worker_status(router, 0, "up")
    deadline = time.monotonic() + 30
    while EXTRA.name not in worker_adapters(cluster["ports"][0]):  # the router's next health check loads it
        assert time.monotonic() < deadline, "the restarted worker did not get the run-time adapter"
        time.sleep(0.2)
    assert [complete(client, EXTRA.name, [5, 6, 7, 8]) for _ in range(4)] == [expected] * 4
    # Both idle: the adapter's requests (other prompts) follow it to worker 1, where ties would go to 0.
    for start in (50, 60, 70):
        before = routed(router)
        complete(client, name, [start, start + 1, start + 2])
        assert routed(router)[1] == before[1] + 1
    assert send(router, "POST", "/v1/unload_lora_adapter", {"lora_name": EXTRA.name}).status == 200

    created = send(router, "POST", "/v1/sessions", {"model": name, "temperature": 0.0, "max_tokens": 4})
    assert created.status == 200, created.text
    sid = json.loads(created.text)["id"]
    turns = [
        send(router, "POST", f"/v1/sessions/{sid}/messages", {"content": text}) for text in ("Hello there.", "More.")
    ]
    assert [t.status for t in turns] == [200, 200], [t.text for t in turns]
    replies = [json.loads(t.text) for t in turns]
    assert {r["model"] for r in replies} == {name}
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8
    other = send(router, "POST", f"/v1/sessions/{sid}/messages", {"content": "x", "model": "tiny-random"})
    assert other.status == 400
    assert send(router, "DELETE", f"/v1/sessions/{sid}").status == 200
    for port in cluster["ports"]:
        snap = wait_idle(port)
        assert snap.kv.used == 0 and snap.kv_requests == 0


def test_a_router_that_never_saw_a_lora_prompt_places_its_prefix_by_the_workers_kv_events(cluster):
    """Router A over worker 1 alone computes a LoRA prompt there; router B over both workers, which never
    saw it, sends a prompt sharing its prefix to worker 1 from worker 1's KV events: the adapter's blocks
    are keyed under its weights digest, which each worker lists with its adapters."""
    ports = cluster["ports"]
    with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as channel:
        listed = WorkerStub(channel).ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=30)
    assert set(listed.digests) == set(listed.adapters) and len(set(listed.digests.values())) == len(listed.digests)
    flags = ("--api-key", KEY_A, "--served-model-name", "tiny-random", "--health-check-interval", "0.3")
    routers = [start_router([ports[1]], *flags), start_router(ports, *flags)]
    try:
        for proc, _ in routers:
            proc.wait_for("Running on", timeout=120)
        (_, a), (_, b) = routers
        name = TINY_ADAPTERS[1].name
        prompt = [(7 * i) % 200 + 3 for i in range(64)]
        body = {"model": name, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert send(a, "POST", "/v1/completions", {**body, "prompt": prompt}).status == 200
        time.sleep(1.0)  # the events reach router B
        reply = send(b, "POST", "/v1/completions", {**body, "prompt": [*prompt[:48], 5, 6, 7, 8]})
        assert reply.status == 200, reply.text
        assert routed(b) == [0, 1]
        assert json.loads(reply.text)["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    finally:
        for proc, _ in routers:
            proc.terminate()
        for proc, _ in routers:
            proc.finish(60)
    for port in ports:
        snap = wait_idle(port)
        assert snap.kv.used == 0 and snap.kv_requests == 0
