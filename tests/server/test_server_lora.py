"""LoRA adapters through the HTTP server, with the official `openai` client: `/v1/models` lists them
with their parent; a request's `model` picks its adapter, and concurrent requests of four adapters
and the base model give transformers + PEFT's greedy tokens; an unknown model is a 404;
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` change the served adapters under load
(behind the API key, 400 for a bad path, 404 for an unknown name) without losing a request or
compiling anything; the KV pool and the LoRA slots are all free afterwards.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from lora_harness import EXTRA, LORA_ENGINE, TINY_ADAPTERS, reference_runs, write_tiny_adapters
from server_harness import KEY_A, MODEL_NAME, send, start_server, wait_until_idle

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from server.state import STATE


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_tiny_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def lora_server(adapters):
    engine = LLMEngine(build_tiny_random(), EngineConfig(**LORA_ENGINE))
    for spec in TINY_ADAPTERS:  # as `--lora-modules` does
        engine.add_lora(spec.name, str(adapters[spec.name]))
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    srv = start_server(async_engine, api_keys=(KEY_A,))
    yield srv, async_engine, engine.num_compilations
    srv.stop()
    async_engine.shutdown()


@pytest.fixture(scope="module")
def client(lora_server):
    srv, _, _ = lora_server
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


def open_stream(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int) -> openai.Stream:
    """A streamed greedy completion of token ids; it returns once the first delta is out (the
    request is in the engine)."""
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )


def read_text(stream: openai.Stream, model: str) -> str:
    text = ""
    for chunk in stream:
        assert chunk.model == model
        text += "".join(choice.text for choice in chunk.choices)
    return text


def expected_text(lora_server, new_ids: list[int]) -> str:
    srv, _, _ = lora_server
    return srv.app[STATE].info.tokenizer.decode(new_ids)


def check_idle(lora_server) -> None:
    srv, async_engine, compiled = lora_server
    snap = wait_until_idle(srv, async_engine)
    assert snap.kv.used == 0 and snap.kv_requests == 0
    assert snap.num_compilations == compiled
    assert srv.engine_call(async_engine, lambda e: e.lone_replica.lora.num_pinned) == 0


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, *(s.name for s in TINY_ADAPTERS)}
    card = client.models.retrieve("attn-r8")
    assert card.parent == MODEL_NAME and card.root == str(adapters["attn-r8"])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


def test_concurrent_requests_of_four_adapters_and_the_base_match_peft(client, lora_server):
    runs = reference_runs()

    def run(case: tuple) -> str:
        model = case[0] or MODEL_NAME
        return read_text(open_stream(client, model, case[1], len(case[2])), model)

    with ThreadPoolExecutor(len(runs)) as pool:
        got = list(pool.map(run, runs))
    assert got == [expected_text(lora_server, new_ids) for _, _, new_ids in runs]
    check_idle(lora_server)
    metrics = send(lora_server[0], "GET", "/metrics").text
    assert metric(metrics, "jaxserve_lora_resident_adapters") == 4
    assert metric(metrics, "jaxserve_lora_device_loads_total") >= 4
    for spec in TINY_ADAPTERS:  # each ran at least its reference cases
        assert metric(metrics, f'jaxserve_lora_requests_total{{adapter="{spec.name}"}}') >= 2


def test_an_unknown_model_is_a_404(client):
    for call in (
        lambda: client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(
            model="no-such-adapter", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ),
    ):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        assert error.value.body["code"] == "model_not_found"


def test_load_and_unload_under_load_lose_nothing(client, lora_server, adapters, tmp_path):
    srv, _, _ = lora_server
    load = {"lora_name": EXTRA.name, "lora_path": str(adapters[EXTRA.name])}
    assert send(srv, "POST", "/v1/load_lora_adapter", load, key=None).status == 401  # behind the API key
    status, _ = _post(srv, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "none")})
    assert status == 400
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "no-such-adapter"})[0] == 404
    runs = [run for run in reference_runs() if run[0] is not None]
    streams = [open_stream(client, name, prompt, len(new_ids)) for name, prompt, new_ids in runs]  # all running
    added = (200, f"Success: LoRA adapter '{EXTRA.name}' added successfully.")
    assert _post(srv, "/v1/load_lora_adapter", load) == added
    extra = open_stream(client, EXTRA.name, [5, 6, 7, 8], 8)
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "mlp-r4"})[0] == 200
    with ThreadPoolExecutor(len(streams) + 1) as pool:
        got = list(pool.map(read_text, streams, [name for name, _, _ in runs]))
        assert read_text(extra, EXTRA.name)
    # The requests running when their adapter was unloaded finished with it.
    assert got == [expected_text(lora_server, new_ids) for _, _, new_ids in runs]
    assert "mlp-r4" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp-r4", prompt="hi", max_tokens=2)
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": EXTRA.name})[0] == 200
    assert _post(srv, "/v1/load_lora_adapter", {"lora_name": "mlp-r4", "lora_path": str(adapters["mlp-r4"])})[0] == 200
    check_idle(lora_server)


def metric(text: str, name: str) -> float:
    """A sample's value in a Prometheus text page."""
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


def _post(srv, path: str, body: dict) -> tuple[int, str]:
    response = send(srv, "POST", path, body, key=KEY_A)
    return response.status, response.text


def test_sessions_and_response_chains_keep_their_adapter(client, lora_server):
    """A session created with an adapter's name runs it on every turn (the same tokens as a chat
    completion of that adapter), pins its adapter's KV and reuses it, and refuses another model;
    a chain of responses likewise."""
    srv, _, _ = lora_server
    state = srv.app[STATE]
    name, other = TINY_ADAPTERS[0].name, TINY_ADAPTERS[1].name
    greedy = {"temperature": 0.0, "max_tokens": 4}
    created = send(srv, "POST", "/v1/sessions", {"model": name, "system": "You are terse.", **greedy})
    assert created.status == 200, created.text
    sid = json.loads(created.text)["id"]
    first = send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": "Say something about the sea."})
    assert first.status == 200, first.text
    reply = json.loads(first.text)
    assert reply["model"] == name
    direct = client.chat.completions.create(
        model=name,
        temperature=0.0,
        max_tokens=4,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about the sea."},
        ],
    )
    assert reply["choices"][0]["message"]["content"] == direct.choices[0].message.content
    session = next(s for s in state.sessions.all() if s.id == sid)
    deadline = time.monotonic() + 10
    while (session.pin is None or session.pin.num_tokens == 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the pin is made in the background after the reply
    assert session.pin is not None and session.pin.num_tokens >= reply["usage"]["prompt_tokens"] // 8 * 8
    second = send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": "More.", "model": name})
    assert second.status == 200, second.text
    assert json.loads(second.text)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8
    refused = send(srv, "POST", f"/v1/sessions/{sid}/messages", {"content": "Again.", "model": other})
    assert refused.status == 400 and json.loads(refused.text)["error"]["code"] == "model_mismatch"

    start = client.responses.create(model=name, input="Name a colour.", max_output_tokens=4, temperature=0.0)
    assert start.model == name
    with pytest.raises(openai.BadRequestError, match="cannot go on"):
        client.responses.create(model=other, input="Another.", previous_response_id=start.id, max_output_tokens=4)
    follow = client.responses.create(
        model=name, input="Another.", previous_response_id=start.id, max_output_tokens=4, temperature=0.0
    )
    assert follow.model == name and follow.usage.input_tokens_details.cached_tokens >= 8
    assert send(srv, "DELETE", f"/v1/sessions/{sid}").status == 200
    check_idle(lora_server)
