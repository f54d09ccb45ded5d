"""LoRA adapters through the router with two workers (child processes, as users start them): the
workers load adapters from `--lora-modules`; the router lists them with their parent, routes
requests of four adapters and the base model to both workers with transformers + PEFT's greedy
tokens, answers 404 for an unknown model, and loads and unloads an adapter on every worker; the
workers' KV pools are free afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import openai
import pytest

from checkpoints.tiny_random import build_tiny_random
from child_process import free_port
from jaxserve.tokenizer import Tokenizer
from lora_harness import EXTRA, LORA_ENGINE, TINY_ADAPTERS, reference_runs, write_tiny_adapters
from router_cluster import routed, start_router, start_worker, wait_idle
from server_harness import KEY_A, send

pytestmark = pytest.mark.slow  # two workers and a router start (about a minute on 2 cores)
ENGINE_FLAGS = [flag for name, value in LORA_ENGINE.items() for flag in
                (["--" + name.replace("_", "-")] if value is True else
                 ["--" + name.replace("_", "-"), *map(str, value if isinstance(value, tuple) else (value,))])]


@pytest.fixture(scope="module")
def cluster(_compilation_cache, tmp_path_factory):
    adapters = write_tiny_adapters(tmp_path_factory.mktemp("adapters"))
    modules = [f"{spec.name}={adapters[spec.name]}" for spec in TINY_ADAPTERS]
    ports = [free_port(), free_port()]
    procs = [start_worker(p, [*ENGINE_FLAGS, "--dtype", "float32", "--lora-modules", *modules],
                          jax.config.jax_compilation_cache_dir) for p in ports]
    for proc in procs:
        proc.wait_for("worker listening", timeout=600)
    router, endpoint = start_router(ports, "--api-key", KEY_A, "--served-model-name", "tiny-random")
    router.wait_for("Running on", timeout=120)
    yield dict(ports=ports, router=endpoint, adapters=adapters)
    for proc in [router, *procs]:
        proc.terminate()
    for proc in [router, *procs]:
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
        out = client.completions.create(model=name or "tiny-random", prompt=prompt, max_tokens=len(new_ids),
                                        temperature=0.0, extra_body={"ignore_eos": True})
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
    outs = [client.completions.create(model=EXTRA.name, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True}).choices[0].text for _ in range(4)]
    assert len(set(outs)) == 1  # the same adapter on either worker
    assert send(router, "POST", "/v1/unload_lora_adapter", {"lora_name": EXTRA.name}).status == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=EXTRA.name, prompt="hi", max_tokens=2)
    for port in cluster["ports"]:
        snap = wait_idle(port)
        assert snap.kv.used == 0 and snap.kv_requests == 0
