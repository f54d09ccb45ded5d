"""`/health` and `/metrics`, on a live engine and on one whose loop is not running."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from jaxserve.async_engine import AsyncEngine
from server.app import build_app
from server.config import ServerConfig
from server_harness import MODEL_NAME, ServerThread, send

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
EXPECTED_FAMILIES = {
    "jaxserve_engine_alive", "jaxserve_num_requests", "jaxserve_kv_blocks", "jaxserve_kv_blocks_total",
    "jaxserve_kv_usage_ratio", "jaxserve_prefix_cache_hit_rate", "jaxserve_prefix_cache_queried_tokens",
    "jaxserve_prefix_cache_hit_tokens", "jaxserve_preemptions", "jaxserve_compilations", "jaxserve_engine_steps",
    "jaxserve_prompt_tokens_computed", "jaxserve_time_to_first_token_seconds", "jaxserve_time_per_output_token_seconds",
    "jaxserve_e2e_request_latency_seconds", "jaxserve_engine_step_seconds", "jaxserve_prompt_tokens",
    "jaxserve_generation_tokens", "jaxserve_requests",
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
