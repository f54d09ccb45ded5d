"""`/v1/embeddings` on the tiny random model through the official client and plain HTTP: every input
shape, float and base64, unit length, the same vector alone or in a batch, usage, `dimensions`,
bad input, metrics, and the KV pool all free after every test."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from server_harness import MODEL_NAME, send, wait_until_idle

from server.state import STATE

TEXTS = ["The quick brown fox", "jumps over the lazy dog", "Hello world!"]


@pytest.fixture(autouse=True)
def kv_all_free_after(server, async_engine, assert_kv_all_free):
    yield
    wait_until_idle(server, async_engine)
    server.engine_call(async_engine, lambda dp: [assert_kv_all_free(e) for e in dp.replicas])


def ok(reply):
    assert reply.status == 200, reply.text
    return reply.json


def test_the_client_embeds_texts_and_token_ids_alike(client, server):
    hidden = server.app[STATE].info.hidden_size
    batch = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == MODEL_NAME
    vectors = np.array([d.embedding for d in batch.data])
    assert vectors.shape == (3, hidden)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.abs(vectors[0] - vectors[1]).max() > 1e-3  # different texts, different vectors
    alone = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1]).data[0].embedding
    np.testing.assert_allclose(alone, vectors[1], atol=1e-5)
    ids = [ok(send(server, "POST", "/tokenize", {"prompt": t}))["tokens"] for t in TEXTS]
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids)
    np.testing.assert_allclose([d.embedding for d in by_ids.data], vectors, atol=1e-5)
    one_list = client.embeddings.create(model=MODEL_NAME, input=ids[2]).data[0].embedding
    np.testing.assert_allclose(one_list, vectors[2], atol=1e-5)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(map(len, ids))


def test_float_and_base64_encodings_agree(server):
    body = {"model": MODEL_NAME, "input": TEXTS[:2]}
    floats = ok(send(server, "POST", "/v1/embeddings", {**body, "encoding_format": "float"}))
    packed = ok(send(server, "POST", "/v1/embeddings", {**body, "encoding_format": "base64"}))
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    for f, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        np.testing.assert_array_equal(decoded, np.array(f["embedding"], np.float32))
    assert floats["usage"] == packed["usage"]


def test_dimensions_is_honoured_at_the_models_size_and_refused_otherwise(server):
    hidden = server.app[STATE].info.hidden_size
    same = ok(send(server, "POST", "/v1/embeddings", {"model": MODEL_NAME, "input": "a b", "dimensions": hidden}))
    assert len(same["data"][0]["embedding"]) == hidden
    reply = send(server, "POST", "/v1/embeddings", {"model": MODEL_NAME, "input": "a b", "dimensions": 8})
    assert reply.status == 400 and reply.json["error"]["param"] == "dimensions"
    assert f"{hidden} dimensions" in reply.json["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": "576"}, "dimensions"),
        ({"input": "a", "pooling": "mean"}, "pooling"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    reply = send(server, "POST", "/v1/embeddings", {"model": MODEL_NAME, **body})
    assert reply.status == 400, reply.text
    assert reply.json["error"]["param"] == param


def test_a_too_long_input_is_refused_with_the_context_length(server):
    reply = send(server, "POST", "/v1/embeddings", {"model": MODEL_NAME, "input": [[5] * 600]})
    assert reply.status == 400 and reply.json["error"]["code"] == "context_length_exceeded"


def test_embeddings_are_counted_in_the_metrics(server):
    def count() -> float:
        for line in send(server, "GET", "/metrics", key=None).text.splitlines():
            if line.startswith("jaxserve_requests_total{") and 'endpoint="embeddings"' in line and '"ok"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count()
    ok(send(server, "POST", "/v1/embeddings", {"model": MODEL_NAME, "input": TEXTS}))
    assert count() == before + 1


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/score", {"text_1": "a", "text_2": ["b"]}), ("/v1/rerank", {"query": "a", "documents": ["b"]})],
)
def test_score_and_rerank_want_an_embedding_model(server, path, body):
    reply = send(server, "POST", path, {"model": MODEL_NAME, **body})
    assert reply.status == 400 and "needs an embedding model" in reply.json["error"]["message"]
