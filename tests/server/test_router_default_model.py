"""The router over one worker on the real default model (SmolLM2-135M-Instruct): the same greedy
chat replies, streamed and not, as the one-process server on the same engine settings."""

from __future__ import annotations

import jax
import openai
import pytest
from child_process import free_port
from router_cluster import start_router, start_worker, wait_idle
from server_harness import ServerThread, running_engine

from checkpoints.registry import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from server.app import build_app
from server.config import ServerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=16,
    num_blocks=128,
    decode_batch_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
)
QUESTIONS = ["What is the capital of France? Answer in one word.", "Name three colours."]


def _flags(config: dict) -> list[str]:
    out = []
    for name, value in config.items():
        out += [f"--{name.replace('_', '-')}", *(str(v) for v in (value if isinstance(value, tuple) else (value,)))]
    return out


def _replies(base_url: str) -> list[tuple[str, str]]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=300)
    out = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        full = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=0)
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
            )
            if chunk.choices
        )
        out.append((full.choices[0].message.content, streamed))
    return out


def test_router_serves_the_default_model_as_one_process_does(_compilation_cache):
    # First: the worker then finds every program in the shared compilation cache.
    with running_engine(DEFAULT_MODEL, EngineConfig(**ENGINE)) as async_engine:
        reference_server = ServerThread(
            build_app(async_engine, ServerConfig(served_model_name=DEFAULT_MODEL, api_keys=("k",)))
        )
        try:
            expected = _replies(reference_server.base_url)
        finally:
            reference_server.stop()
    assert "Paris" in expected[0][0] and all(full == streamed for full, streamed in expected)
    port = free_port()
    with start_worker(port, _flags(ENGINE), jax.config.jax_compilation_cache_dir, model=DEFAULT_MODEL) as worker:
        worker.wait_for("worker listening", timeout=900)
        router, endpoint = start_router([port], "--api-key", "k")
        with router:
            router.wait_for("Running on", timeout=120)
            assert _replies(endpoint.base_url) == expected
            snap = wait_idle(port)
            assert snap.kv_requests == 0 and snap.kv.used == 0
