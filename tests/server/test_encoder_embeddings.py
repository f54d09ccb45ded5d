"""An encoder embedding model served: all-MiniLM-L6-v2 (fetched by its registry name) behind a
real server, used with the official `openai` client and plain HTTP.

The golden vectors (tests/data/minilm_golden.json) are sentence-transformers' own, made by
tests/data/make_minilm_golden.py in a separate torch environment; every one of the 384 dimensions
of every text is compared, so a wrong layer, norm, position or pooling shows.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
from pathlib import Path

import numpy as np
import openai
import pytest
from server_harness import KEY_A, ServerThread, send, wait_until_idle

from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import make_engine
from server.app import build_app
from server.config import ServerConfig

MODEL = "all-minilm-l6-v2"
GOLDEN = json.loads((Path(__file__).parent.parent / "data" / "minilm_golden.json").read_text(encoding="utf-8"))
MAX_LEN = 64  # fewer buckets to compile on CI; the model itself takes 256


@pytest.fixture(scope="module")
def minilm():
    engine = make_engine(MODEL, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=MAX_LEN))
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    srv = ServerThread(build_app(async_engine, ServerConfig(served_model_name=MODEL, api_keys=(KEY_A,))))
    yield srv, async_engine, engine.num_compilations
    snap = wait_until_idle(srv, async_engine)
    assert not snap.has_unfinished and snap.kv.used == 0 and snap.kv_requests == 0
    assert snap.num_compilations == engine.num_compilations  # nothing compiled while serving
    srv.stop()
    async_engine.shutdown()


@pytest.fixture(scope="module")
def client(minilm):
    return openai.OpenAI(base_url=minilm[0].base_url + "/v1", api_key=KEY_A, max_retries=0)


def _cosine_distance(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_minilm_matches_sentence_transformers(minilm, client):
    reply = client.embeddings.create(model=MODEL, input=GOLDEN["texts"])
    assert [d.index for d in reply.data] == list(range(len(GOLDEN["texts"])))
    for got, want, text in zip(reply.data, GOLDEN["vectors"], GOLDEN["texts"]):
        assert len(got.embedding) == 384
        assert _cosine_distance(got.embedding, want) < 1e-5, text
        np.testing.assert_allclose(got.embedding, want, atol=2e-5)  # normalised, like sentence-transformers'
    assert reply.usage.prompt_tokens == sum(len(t) for t in _token_ids(minilm[0], GOLDEN["texts"]))


def _token_ids(srv, texts):
    return [send(srv, "POST", "/tokenize", {"model": MODEL, "prompt": t}).json["tokens"] for t in texts]


def test_token_arrays_base64_and_one_at_a_time_agree(minilm, client):
    texts = GOLDEN["texts"][:3]
    together = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data]
    ids = _token_ids(minilm[0], texts)
    as_ids = client.embeddings.create(model=MODEL, input=ids).data
    as_b64 = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64").data
    for i, text in enumerate(texts):
        alone = client.embeddings.create(model=MODEL, input=text).data[0].embedding
        np.testing.assert_allclose(alone, together[i], atol=1e-6)  # batch composition does not matter
        np.testing.assert_allclose(as_ids[i].embedding, together[i], atol=1e-6)
        decoded = np.frombuffer(base64.b64decode(as_b64[i].embedding), "<f4")
        np.testing.assert_allclose(decoded, together[i], atol=1e-6)


def test_paraphrases_are_closer_than_unrelated_texts(client):
    v = [np.asarray(d.embedding) for d in client.embeddings.create(model=MODEL, input=GOLDEN["texts"][:6]).data]
    guitar, music, stocks, reset, forgot, sugar = v
    assert guitar @ music > 0.5 > max(guitar @ stocks, guitar @ reset, guitar @ sugar)
    assert reset @ forgot > 0.5 > max(reset @ stocks, reset @ sugar, reset @ music)


def test_concurrent_requests_share_steps(minilm, client):
    srv, async_engine, _ = minilm
    before = srv.run(async_engine.snapshot()).num_steps
    texts = [f"request number {i} about {GOLDEN['texts'][i % 8]}" for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        replies = list(pool.map(lambda t: client.embeddings.create(model=MODEL, input=t), texts))
    steps = srv.run(async_engine.snapshot()).num_steps - before
    assert all(len(r.data[0].embedding) == 384 for r in replies)
    assert steps < len(texts), f"{steps} steps for {len(texts)} concurrent requests: nothing was batched"
    alone = client.embeddings.create(model=MODEL, input=texts[5]).data[0].embedding
    np.testing.assert_allclose(replies[5].data[0].embedding, alone, atol=1e-6)


def test_score_and_rerank(minilm, client):
    srv = minilm[0]
    texts = GOLDEN["texts"]
    v = [np.asarray(d.embedding) for d in client.embeddings.create(model=MODEL, input=texts[:5]).data]
    score = send(srv, "POST", "/v1/score", {"model": MODEL, "text_1": texts[0], "text_2": texts[1:5]})
    assert score.status == 200, score.text
    assert [d["index"] for d in score.json["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in score.json["data"]], [v[0] @ v[i] for i in range(1, 5)], atol=1e-5)
    pairwise = send(srv, "POST", "/score", {"model": MODEL, "text_1": texts[:2], "text_2": texts[3:5]}).json
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], [v[0] @ v[3], v[1] @ v[4]], atol=1e-5)
    rerank = send(srv, "POST", "/v1/rerank", {"model": MODEL, "query": texts[3], "documents": texts[:3] + [texts[4]]})
    assert rerank.status == 200, rerank.text
    results = rerank.json["results"]
    assert results[0]["index"] == 3 and results[0]["document"]["text"] == texts[4]
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    top = send(srv, "POST", "/rerank", {"query": texts[0], "documents": texts[1:4], "top_n": 1}).json["results"]
    assert len(top) == 1 and top[0]["index"] == 0


def test_models_says_embedding_and_generation_is_refused(minilm, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["task"] == "embed"
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in chat.value.body["message"] and chat.value.body["code"] == "model_not_generative"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi")
    srv = minilm[0]
    responses = send(srv, "POST", "/v1/responses", {"model": MODEL, "input": "hi"})
    assert responses.status == 400 and responses.json["error"]["code"] == "model_not_generative"
    messages = send(
        srv, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert messages.status == 400 and messages.json["type"] == "error"  # Anthropic's error shape
    assert send(srv, "GET", "/health", key=None).json == {"status": "ok"}
    assert send(srv, "GET", "/metrics", key=None).status == 200


def test_truncate_prompt_tokens_keeps_the_start_and_sep(minilm, client):
    long_text = " ".join(["word"] * 100)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.embeddings.create(model=MODEL, input=long_text)
    assert too_long.value.body["code"] == "context_length_exceeded" and str(MAX_LEN) in too_long.value.body["message"]
    ids = _token_ids(minilm[0], [long_text])[0]
    kept = ids[:15] + ids[-1:]
    truncated = client.embeddings.create(model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 16})
    by_ids = client.embeddings.create(model=MODEL, input=[kept])
    np.testing.assert_allclose(truncated.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    assert truncated.usage.prompt_tokens == 16


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": [["a"]]}, 400, "input"),
        ({"input": ["ok", 3]}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": [[101, 30522, 102]]}, 400, "input"),
        ({"input": ["x"] * 2049}, 400, "input"),
        ({"input": [[101] + [1000] * MAX_LEN]}, 400, "input"),
        ({"input": "hi", "dimensions": 128}, 400, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"input": "hi", "model": "no-such-model"}, 404, None),
        ({"input": "hi", "temperature": 1}, 400, None),
    ],
)
def test_bad_input_gets_openai_errors(minilm, body, status, param):
    reply = send(minilm[0], "POST", "/v1/embeddings", {"model": MODEL, **body})
    assert reply.status == status, reply.text
    error = reply.json["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/score", {"text_1": "a"}),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}),
        ("/v1/score", {"text_1": "a", "text_2": [1]}),
        ("/v1/rerank", {"query": "a", "documents": "b"}),
        ("/v1/rerank", {"query": 1, "documents": ["b"]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}),
        ("/v1/rerank", {"query": "a", "documents": [" ".join(["w"] * 200)]}),
    ],
)
def test_bad_score_and_rerank_input(minilm, path, body):
    reply = send(minilm[0], "POST", path, {"model": MODEL, **body})
    assert reply.status == 400, reply.text
    assert reply.json["error"]["message"]
