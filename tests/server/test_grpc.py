"""The gRPC service: a real grpc.aio server on the HTTP app's loop, called with the generated stubs.

Both APIs share the tiny-random engine, keys, limits and metrics; the gRPC results must equal
the HTTP API's (and the engine's) for the same request, and every test leaves the KV pool free.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from typing import Any

import grpc
import pytest
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from server_harness import KEY_A, KEY_B, MODEL_NAME, ServerThread, send, wait_until_idle

from jaxserve.async_engine import AsyncEngine
from jaxserve.sampling_params import SamplingParams
from server.app import build_app
from server.config import ServerConfig
from server.errors import APIError
from server.grpc_api import jaxserve_pb2 as pb
from server.grpc_api import jaxserve_pb2_grpc as pb_grpc
from server.grpc_api.server import GrpcServer
from server.grpc_api.status import status_code
from server.state import STATE

PROMPT = "The quick brown fox jumps over the lazy dog."
CHAT = [("system", "You are terse."), ("user", "Hello world! What is a fox?")]


class Served:
    """An HTTP app and its gRPC service, on one loop thread, and a client stub for the latter."""

    def __init__(self, engine: AsyncEngine, **config: Any) -> None:
        app = build_app(engine, ServerConfig(served_model_name=MODEL_NAME, api_keys=(KEY_A, KEY_B), **config))
        self.grpc = GrpcServer("127.0.0.1", 0).attach(app)
        self.http = ServerThread(app)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc.port}")
        self.stub = pb_grpc.JaxServeStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.http.stop()


@pytest.fixture(scope="module")
def served(async_engine) -> Iterator[Served]:
    s = Served(async_engine)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def kv_all_free_after(served, async_engine, assert_kv_all_free):
    yield
    wait_until_idle(served.http, async_engine)
    served.http.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def auth(key: str | None = KEY_A) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key is not None else ()


def generate(stub: pb_grpc.JaxServeStub, key: str | None = KEY_A, **request: Any) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**request), metadata=auth(key), timeout=60))


def by_choice(messages: list[pb.GenerateResponse]) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str]]:
    """Text, token ids and finish reason of each choice."""
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    for m in messages:
        assert m.index not in finish, "output after the choice finished"
        texts[m.index] = texts.get(m.index, "") + m.text
        tokens.setdefault(m.index, []).extend(m.token_ids)
        if m.finish_reason:
            finish[m.index] = m.finish_reason
    return texts, tokens, finish


def assert_usage_only_at_the_end(messages: list[pb.GenerateResponse]) -> pb.Usage:
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    usage = messages[-1].usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return usage


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    """The error that `call` (a whole RPC) fails with."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def trailers(error: grpc.RpcError) -> dict[str, str]:
    return dict(error.trailing_metadata() or ())


async def engine_tokens(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async with aclosing(engine.generate("test-grpc-direct", ids, params)) as stream:
        async for delta in stream:
            tokens += delta.token_ids
    return tokens


def test_text_prompt_streams_what_http_and_the_engine_give(served, async_engine):
    params = pb.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    messages = generate(served.stub, text=PROMPT, sampling_params=params)
    assert len(messages) > 1  # streamed, not one reply
    assert len({m.request_id for m in messages}) == 1 and messages[0].request_id.startswith("grpc-")
    texts, tokens, finish = by_choice(messages)
    usage = assert_usage_only_at_the_end(messages)

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    http = send(served.http, "POST", "/v1/completions", body).json
    assert texts == {0: http["choices"][0]["text"]} and finish == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (http["usage"]["prompt_tokens"], 12)

    ids = served.http.app[STATE].info.tokenizer.encode(PROMPT)
    direct = served.http.run(
        engine_tokens(async_engine, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    )
    assert tokens == {0: direct}


def test_token_ids_prompt_equals_the_text_prompt_and_reports_logprobs(served):
    ids = served.http.app[STATE].info.tokenizer.encode(PROMPT)
    params = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    by_text = by_choice(generate(served.stub, text=PROMPT, sampling_params=params))
    messages = generate(served.stub, token_ids=pb.TokenIds(ids=ids), sampling_params=params)
    assert by_choice(messages) == by_text
    assert assert_usage_only_at_the_end(messages).prompt_tokens == len(ids)
    for m in messages:
        assert [e.token_id for e in m.logprobs] == list(m.token_ids)
        for entry in m.logprobs:
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token_id == entry.token_id  # greedy
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


def test_chat_messages_equal_the_http_chat_completion(served):
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in CHAT])
    out = generate(
        served.stub,
        model=MODEL_NAME,
        messages=messages,
        sampling_params=pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    )
    texts, _, finish = by_choice(out)
    usage = assert_usage_only_at_the_end(out)
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": r, "content": c} for r, c in CHAT],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    http = send(served.http, "POST", "/v1/chat/completions", body).json
    assert texts == {0: http["choices"][0]["message"]["content"]} and finish == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (http["usage"]["prompt_tokens"], 10)


def test_seeded_n_choices_and_stop_strings_follow_http(served):
    params = dict(max_tokens=8, temperature=0.8, seed=11, n=2, ignore_eos=True)
    out = generate(served.stub, text=PROMPT, sampling_params=pb.SamplingParams(**params))
    texts, tokens, finish = by_choice(out)
    assert sorted(texts) == [0, 1] and finish == {0: "length", 1: "length"}
    assert assert_usage_only_at_the_end(out).completion_tokens == 16
    http = send(served.http, "POST", "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, **params}).json
    assert texts == {c["index"]: c["text"] for c in http["choices"]}

    greedy = by_choice(
        generate(
            served.stub, text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        )
    )[0][0]
    stop = next(c for c in greedy[2:] if c.isascii() and c.isalnum())
    stopped = generate(
        served.stub,
        text=PROMPT,
        sampling_params=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]),
    )
    assert by_choice(stopped)[0] == {0: greedy[: greedy.index(stop)]}
    assert by_choice(stopped)[2] == {0: "stop"}


def test_logit_bias_forces_and_bans_tokens(served):
    def tokens(bias: dict[int, float]) -> list[int]:
        params = pb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias=bias)
        return by_choice(generate(served.stub, text=PROMPT, sampling_params=params))[1][0]

    assert tokens({90: 100}) == [90] * 5
    assert tokens({90: -100, 91: 100}) == [91] * 5


def _params(**kw: Any) -> dict[str, Any]:
    return {"text": "Hello", "sampling_params": pb.SamplingParams(**kw)}


BAD_REQUESTS = [
    ({}, "the request has no prompt", "prompt"),
    ({"text": ""}, "the prompt is empty", "prompt"),
    ({"token_ids": pb.TokenIds(ids=[1, 10**6])}, "prompt token ids must be in [0, ", "prompt"),
    ({"token_ids": pb.TokenIds(ids=[5] * 600)}, "maximum context length is 512 tokens", "prompt"),
    (
        {"token_ids": pb.TokenIds(ids=[5] * 100), "sampling_params": pb.SamplingParams(max_tokens=500)},
        "maximum context length is 512 tokens",
        "max_tokens",
    ),
    ({"messages": pb.ChatMessages()}, "messages must be a non-empty list", "messages"),
    (
        {"messages": pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="hi")])},
        "messages[0].role must be one of",
        "messages",
    ),
    (_params(max_tokens=0), "max_tokens must be at least 1", "max_tokens"),
    (_params(max_tokens=513), "max_tokens must be at most 512", "max_tokens"),
    (_params(temperature=-1), "temperature must be non-negative", "temperature"),
    (_params(top_p=0), "top_p must be in (0, 1]", "top_p"),
    (_params(top_k=-2), "top_k must be 0 or -1 (off) or at least 1", "top_k"),
    (_params(n=0), "n must be at least 1", "n"),
    (_params(n=9), "n must be at most 8", "n"),
    (_params(logprobs=21), "logprobs must be in [0, 20]", "logprobs"),
    (_params(stop=[""]), "stop cannot contain an empty string", "stop"),
    (_params(max_tokens=4, min_tokens=5), "min_tokens must be in [0, max_tokens=4]", "min_tokens"),
    (_params(logit_bias={5: 101}), "logit_bias values must be numbers in [-100, 100]", "logit_bias"),
    (_params(logit_bias={10**6: 1}), "logit_bias token ids must be in [0, ", "logit_bias"),
]


@pytest.mark.parametrize("request_fields,message,param", BAD_REQUESTS, ids=[c[1] for c in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_with_a_clear_message(served, request_fields, message, param):
    error = rpc_error(lambda: generate(served.stub, **request_fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert trailers(error)["error-param"] == param


def test_too_long_prompt_names_the_openai_error_code(served):
    error = rpc_error(lambda: generate(served.stub, token_ids=pb.TokenIds(ids=[5] * 600)))
    assert trailers(error)["error-code"] == "context_length_exceeded"


def test_a_request_over_the_body_limit_is_refused(served):
    error = rpc_error(lambda: generate(served.stub, text="x" * (2 << 20)))  # the limit is 1 MiB, as for HTTP
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_another_model_is_not_found(served):
    error = rpc_error(lambda: generate(served.stub, model="gpt-4", text="Hello"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'gpt-4' does not exist" in error.details()


def test_api_keys_guard_generate_and_list_models_but_not_health(served):
    stub = served.stub
    for key, message in ((None, "missing API key"), ("wrong-key", "incorrect API key")):
        for call in (
            lambda: generate(stub, key=key, text="Hello"),
            lambda: stub.ListModels(pb.ListModelsRequest(), metadata=auth(key), timeout=10),
        ):
            error = rpc_error(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and message in error.details()
    no_scheme = (("authorization", KEY_A),)
    malformed = rpc_error(lambda: list(stub.Generate(pb.GenerateRequest(text="Hi"), metadata=no_scheme, timeout=10)))
    assert malformed.code() == grpc.StatusCode.UNAUTHENTICATED

    assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING
    models = stub.ListModels(pb.ListModelsRequest(), metadata=auth(KEY_B), timeout=10).models
    info = served.http.app[STATE].info
    assert [(m.id, m.max_model_len, m.vocab_size) for m in models] == [(MODEL_NAME, 512, info.vocab_size)]
    assert by_choice(generate(stub, key=KEY_B, text="Hi", sampling_params=pb.SamplingParams(max_tokens=2)))[2]


def test_full_queue_and_rate_limit_are_resource_exhausted_and_shared_with_http(async_engine):
    limited = Served(async_engine, rate_limit_rpm=2, max_waiting_seqs=0, max_n=128)
    try:
        # 65 sequences never fit a server that holds 64: invalid, not "retry later".
        too_large = rpc_error(lambda: generate(limited.stub, text="Hello", sampling_params=pb.SamplingParams(n=65)))
        assert too_large.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 64" in too_large.details()
        assert trailers(too_large)["error-code"] == "request_too_large"
        overloaded = APIError(503, "the server is overloaded", code="server_overloaded")
        assert status_code(overloaded) == grpc.StatusCode.RESOURCE_EXHAUSTED
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
        assert send(limited.http, "POST", "/v1/completions", body).status == 200  # the key's second request
        limit = rpc_error(lambda: generate(limited.stub, text="Hello"))
        assert limit.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rate limit of 2 requests per minute" in limit.details()
        assert trailers(limit)["error-code"] == "rate_limit_exceeded_requests"
        assert 1 <= int(trailers(limit)["retry-after"]) <= 60
        assert generate(limited.stub, key=KEY_B, text="Hello", sampling_params=pb.SamplingParams(max_tokens=2))
    finally:
        limited.close()


def test_stopped_engine_is_unavailable_and_not_serving(warm_engine):
    stopped = Served(AsyncEngine(warm_engine.async_engine.engine))  # never started: its loop is not running
    try:
        health = stopped.stub.Health(pb.HealthRequest(), timeout=10)
        assert health.status == pb.HealthResponse.NOT_SERVING and health.detail == "engine: stopped"
        error = rpc_error(lambda: generate(stopped.stub, text="Hello"))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details() == "the engine is not running"
    finally:
        stopped.close()


def test_client_cancel_aborts_the_request_in_the_engine(served, async_engine):
    registry = served.http.app[STATE].metrics.registry
    labels = {"endpoint": "grpc", "outcome": "cancelled"}
    cancelled_before = registry.get_sample_value("jaxserve_requests_total", labels) or 0.0
    generated_before = served.http.engine_call(async_engine, lambda e: e.stats.generated_tokens)
    call = served.stub.Generate(
        pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True)),
        metadata=auth(),
        timeout=60,
    )
    stream = iter(call)
    next(stream), next(stream)
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED

    wait_until_idle(served.http, async_engine)
    generated = served.http.engine_call(async_engine, lambda e: e.stats.generated_tokens) - generated_before
    assert generated < 100  # aborted, not run to its 400 tokens
    deadline = time.monotonic() + 10
    while (registry.get_sample_value("jaxserve_requests_total", labels) or 0.0) != cancelled_before + 1:
        assert time.monotonic() < deadline, "the cancelled call was not counted"
        time.sleep(0.02)


def test_serve_flag_sets_the_grpc_port():
    from jaxserve.cli import build_parser
    from server.cli import server_config_from_args

    args = build_parser().parse_args(["serve", "--model", MODEL_NAME, "--grpc-port", "50051"])
    assert server_config_from_args(args).grpc_port == 50051
    assert server_config_from_args(build_parser().parse_args(["serve"])).grpc_port == 0  # off by default
    with pytest.raises(ValueError, match="grpc_port"):
        ServerConfig(port=8000, grpc_port=8000)


def test_serve_with_grpc_port_serves_both_apis_and_drains_grpc_on_sigterm():
    http_port, grpc_port = free_port(), free_port()
    command = jaxserve(
        "serve",
        "--model",
        MODEL_NAME,
        "--port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--api-key",
        "k1",
        *SMALL_ENGINE,
    )
    with ChildProcess(command) as child:
        child.wait_for("Running on", timeout=240)
        child.wait_for(f"gRPC service listening on 127.0.0.1:{grpc_port}", timeout=1)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.JaxServeStub(channel)
            assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.SERVING
            # A stream in flight when SIGTERM arrives runs to its end before the process exits.
            request = pb.GenerateRequest(
                text="Hello", sampling_params=pb.SamplingParams(max_tokens=150, ignore_eos=True)
            )
            stream = iter(stub.Generate(request, metadata=auth("k1"), timeout=60))
            messages = [next(stream)]
            child.terminate()
            messages += list(stream)
        assert by_choice(messages)[2] == {0: "length"} and messages[-1].usage.completion_tokens == 150
        assert child.finish(60) == 0
        assert "server stopped" in child.seen
        assert "Traceback" not in child.output, child.output
