"""Property-based fuzz of the gRPC `Generate` call: the HTTP API's rules hold for every value
the schema can carry (uint32 / int64 / double extremes, NaN, long stop lists, odd roles), and for
bytes that are not a valid message at all. No call ends INTERNAL or UNKNOWN; afterwards the
engine serves and its KV pool is idle."""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import MODEL_NAME, ServerThread, assert_serving_and_idle

from server.app import build_app
from server.config import ServerConfig
from server.grpc_api import jaxserve_pb2 as pb
from server.grpc_api import jaxserve_pb2_grpc as pb_grpc
from server.grpc_api.server import GrpcServer

EXAMPLES = 150
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CODES: collections.Counter = collections.Counter()
FUZZ_KEY = "key-grpc-fuzz"
FAILURES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

uint32 = st.one_of(st.integers(0, 6), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
int32 = st.one_of(st.integers(-2, 6), st.sampled_from([-(2**31), 2**31 - 1]))
int64 = st.one_of(st.integers(-2, 6), st.sampled_from([-(2**63), 2**63 - 1]))
doubles = st.one_of(st.floats(-3, 3), st.floats(), st.sampled_from([1e-45, 1e39]))
texts = st.one_of(st.text(max_size=12), st.sampled_from(["x" * 300, "<|im_start|>", "\ue000 0 \ue000", "\x00"]))
sampling = st.builds(
    lambda fields: pb.SamplingParams(**fields),
    st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.one_of(st.integers(1, 4), uint32),
            "temperature": doubles,
            "top_p": doubles,
            "top_k": int32,
            "min_p": doubles,
            "presence_penalty": doubles,
            "frequency_penalty": doubles,
            "repetition_penalty": doubles,
            "stop": st.lists(texts, max_size=18),
            "stop_token_ids": st.lists(uint32, max_size=4),
            "ignore_eos": st.booleans(),
            "seed": int64,
            "n": st.one_of(st.integers(1, 3), uint32),
            "priority": int32,
            "skip_special_tokens": st.booleans(),
            "logprobs": st.one_of(st.integers(0, 3), uint32),
            "logit_bias": st.dictionaries(uint32, doubles, max_size=3),
            "min_tokens": st.one_of(st.integers(0, 3), uint32),
            "include_stop_str_in_output": st.booleans(),
        },
    ),
)
messages = st.builds(
    pb.ChatMessages,
    messages=st.lists(
        st.builds(
            pb.ChatMessage,
            role=st.one_of(st.sampled_from(["system", "user", "assistant", "developer"]), texts),
            content=texts,
        ),
        max_size=3,
    ),
)
prompt = st.one_of(
    st.fixed_dictionaries({"text": texts}),
    st.fixed_dictionaries({"token_ids": st.builds(pb.TokenIds, ids=st.lists(uint32, max_size=5))}),
    st.fixed_dictionaries({"messages": messages}),
    st.just({}),
)
requests = st.builds(
    lambda p, s, model: pb.GenerateRequest(model=model, sampling_params=s, **p),
    prompt,
    sampling,
    st.sampled_from(["", MODEL_NAME, "gpt-17"]),
)
not_messages = st.one_of(
    st.binary(max_size=40),
    st.just(b"\x12\x02\xff\xfe"),  # field 2 (text) holding bytes that are not UTF-8
    st.just(b"\x22\x06\x0a\x04\x0a\x02\xc3\x28"),
)  # a chat role that is not UTF-8


@pytest.fixture(scope="module")
def fuzzed(async_engine):
    app = build_app(async_engine, ServerConfig(served_model_name=MODEL_NAME, api_keys=(FUZZ_KEY,)))
    service = GrpcServer("127.0.0.1", 0).attach(app)
    http = ServerThread(app)
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    raw = channel.unary_stream(
        "/jaxserve.v1.JaxServe/Generate", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString
    )
    yield http, pb_grpc.JaxServeStub(channel), raw
    channel.close()
    http.stop()


def _call(call) -> None:
    try:
        list(call)
        CODES[grpc.StatusCode.OK] += 1
    except grpc.RpcError as e:
        CODES[e.code()] += 1
        assert e.code() not in FAILURES, (e.code(), e.details())


@FUZZ
@given(request=requests, key=st.sampled_from([FUZZ_KEY, FUZZ_KEY, FUZZ_KEY, None, "wrong"]))
def test_no_generate_request_fails_internally(fuzzed, request, key):
    _, stub, _ = fuzzed
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    _call(stub.Generate(request, metadata=metadata, timeout=60))


@settings(FUZZ, max_examples=40)
@given(data=not_messages)
def test_bytes_that_are_not_a_request_are_invalid_argument(fuzzed, data):
    _, _, raw = fuzzed
    _call(raw(data, metadata=(("authorization", f"Bearer {FUZZ_KEY}"),), timeout=60))


def test_after_the_grpc_fuzz_the_engine_serves_and_its_pool_is_idle(fuzzed, async_engine):
    http, stub, _ = fuzzed
    print(f"\ngrpc fuzz: {sum(CODES.values())} calls; codes {dict((c.name, n) for c, n in CODES.items())}")
    assert sum(CODES.values()) >= EXAMPLES and not any(CODES[c] for c in FAILURES)
    assert_serving_and_idle(http, async_engine, FUZZ_KEY)
    replies = list(
        stub.Generate(
            pb.GenerateRequest(text="Hello", sampling_params=pb.SamplingParams(max_tokens=3)),
            metadata=(("authorization", f"Bearer {FUZZ_KEY}"),),
            timeout=60,
        )
    )
    assert sum(len(r.token_ids) for r in replies) == 3
