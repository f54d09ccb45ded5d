"""`/health` and `/metrics`, on a live engine and on one whose loop is not running; `/openapi.json`
describes every route with the fields its handler accepts."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, TEST_ENGINE, ServerThread, send, start_server

from checkpoints.tiny_random import build_tiny_random
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.speculative.config import SpeculativeConfig
from server.app import build_app
from server.config import ServerConfig

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
EXPECTED_FAMILIES = {
    "jaxserve_engine_alive",
    "jaxserve_num_requests",
    "jaxserve_kv_blocks",
    "jaxserve_kv_blocks_total",
    "jaxserve_kv_usage_ratio",
    "jaxserve_prefix_cache_hit_rate",
    "jaxserve_prefix_cache_queried_tokens",
    "jaxserve_prefix_cache_hit_tokens",
    "jaxserve_preemptions",
    "jaxserve_compilations",
    "jaxserve_engine_steps",
    "jaxserve_prompt_tokens_computed",
    "jaxserve_time_to_first_token_seconds",
    "jaxserve_time_per_output_token_seconds",
    "jaxserve_e2e_request_latency_seconds",
    "jaxserve_engine_step_seconds",
    "jaxserve_prompt_tokens",
    "jaxserve_generation_tokens",
    "jaxserve_requests",
    "jaxserve_spec_decode_steps",
    "jaxserve_spec_decode_draft_tokens",
    "jaxserve_spec_decode_accepted_tokens",
}


def families(srv) -> dict[str, object]:
    reply = send(srv, "GET", "/metrics", key=None)
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(reply.text)}


def test_metrics_exports_engine_and_request_families(server):
    assert send(server, "POST", "/v1/chat/completions", CHAT).status == 200
    found = families(server)
    assert EXPECTED_FAMILIES <= set(found), EXPECTED_FAMILIES - set(found)
    states = {s.labels["state"] for s in found["jaxserve_kv_blocks"].samples}
    assert states == {"used", "free", "cached", "cached_idle", "pinned"}
    rate = found["jaxserve_prefix_cache_hit_rate"].samples[0].value
    assert 0.0 <= rate <= 1.0


def test_a_stopped_engine_is_unhealthy_and_refuses_work(async_engine):
    stopped = AsyncEngine(async_engine.engine)  # never started: its loop is not running
    srv = ServerThread(build_app(stopped, ServerConfig(served_model_name=MODEL_NAME)))
    try:
        health = send(srv, "GET", "/health", key=None)
        assert health.status == 503 and health.json["status"] == "error"
        refused = send(srv, "POST", "/v1/chat/completions", CHAT, key=None)
        assert refused.status == 503 and refused.json["error"]["code"] == "engine_unavailable"
        streamed = send(srv, "POST", "/v1/chat/completions", {**CHAT, "stream": True}, key=None)
        assert streamed.status == 503
        found = families(srv)
        assert found["jaxserve_engine_alive"].samples[0].value == 0
        assert "jaxserve_kv_blocks" not in found
    finally:
        srv.stop()


def test_metrics_count_speculative_drafts_and_acceptances(assert_kv_all_free):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec["adaptive_draft_length"] = False
    engine = LLMEngine(
        build_tiny_random(), EngineConfig(**TEST_ENGINE, speculative_config=SpeculativeConfig.from_dict(spec))
    )
    ae = AsyncEngine(engine)
    ae.start()
    srv = start_server(ae)
    try:
        for first in range(4):  # prompts that repeat a span: its n-grams recur (greedy loops do too)
            span = [first + 5, 17, 9, 33, 21, 8]
            body = {"model": MODEL_NAME, "prompt": span * 4, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
            assert send(srv, "POST", "/v1/completions", body, key=None).status == 200
        spec_families = {name: f for name, f in families(srv).items() if name.startswith("jaxserve_spec_decode")}
        found = {name: f.samples[0].value for name, f in spec_families.items() if "position" not in name}
        stats = engine.stats
        assert found == {
            "jaxserve_spec_decode_steps": stats.speculative_steps,
            "jaxserve_spec_decode_draft_tokens": stats.draft_tokens,
            "jaxserve_spec_decode_accepted_tokens": stats.accepted_tokens,
            "jaxserve_spec_decode_num_drafts": stats.num_drafts,
            "jaxserve_spec_decode_mean_accepted_tokens": stats.accepted_tokens / stats.num_drafts,
            "jaxserve_spec_decode_draft_seconds": pytest.approx(engine.proposer.draft_seconds),
            "jaxserve_spec_decode_chosen_draft_tokens": engine.proposer.draft_length.chosen_tokens,
            "jaxserve_spec_decode_draft_length_steps": engine.proposer.draft_length.decode_steps,
            "jaxserve_spec_decode_mean_draft_length": engine.snapshot().mean_draft_length,
        }
        assert stats.speculative_steps > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
        # Pinned: k = 3 chosen at every decode step but those of an n-gram pause (after a step with no draft).
        assert 0 < found["jaxserve_spec_decode_mean_draft_length"] <= 3
        # Per draft position (k = 3): drafts with a token there never grow with the position, and their sums
        # are the totals.
        per_position = {
            name: {s.labels["position"]: s.value for s in samples}
            for name, samples in (
                (name, spec_families[f"jaxserve_spec_decode_position_{name}"].samples)
                for name in ("draft_tokens", "accepted_tokens", "acceptance_rate")
            )
        }
        drafted, accepted = per_position["draft_tokens"], per_position["accepted_tokens"]
        assert list(drafted) == ["0", "1", "2"] and drafted["0"] >= drafted["1"] >= drafted["2"]
        assert sum(drafted.values()) == stats.draft_tokens and sum(accepted.values()) == stats.accepted_tokens
        assert per_position["acceptance_rate"] == {j: accepted[j] / drafted[j] if drafted[j] else 0.0 for j in drafted}
    finally:
        srv.stop()
        ae.shutdown()
    assert_kv_all_free(engine)  # the engine loop has stopped: read from this thread


def test_openapi_describes_every_route_with_the_fields_it_accepts(server):
    from server.response_request import RESPONSE_FIELDS
    from server.routes_embeddings import EMBEDDING_FIELDS

    reply = send(server, "GET", "/openapi.json", key=None)  # no key needed
    assert reply.status == 200
    doc = reply.json
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "jaxserve"
    served = {(r.method.lower(), r.resource.canonical) for r in server.app.router.routes() if r.method != "HEAD"}
    described = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert described == served
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["summary"], (method, path)
            assert [p["name"] for p in op.get("parameters", [])] == [
                part[1:-1] for part in path.split("/") if part.startswith("{")
            ]
    for path, fields, required in (
        ("/v1/responses", RESPONSE_FIELDS, ["input"]),
        ("/v1/embeddings", EMBEDDING_FIELDS, ["input"]),
    ):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == fields and schema["required"] == required
    assert {
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/responses/{response_id}/input_items",
        "/tokenizer_info",
    } <= set(doc["paths"])
