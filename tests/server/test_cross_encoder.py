"""A cross-encoder (a one-label `BertForSequenceClassification` reranker) served by `/v1/score` and
`/v1/rerank`: each pair read as one input, scored by BERT's pooler and classifier.

The reference (tests/data/cross_encoder_reference.json) is sentence-transformers' `CrossEncoder.predict`
on the same tiny random directory (made by tests/data/make_cross_encoder_reference.py, which also
checks that transformers loads every weight); the test writes the directory again from the same seed.
The same scores come through `jaxserve router` over a `jaxserve worker` serving the reranker.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from encoder_dirs import write_cross_encoder
from router_cluster import wait_idle, worker_behind_router
from server_harness import KEY_A, ServerThread, send, wait_until_idle

from checkpoints.encoders import load_encoder
from checkpoints.errors import UnsupportedCheckpointError
from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import make_engine
from jaxserve.model.encoder import token_types
from server.app import build_app
from server.config import ServerConfig

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "cross_encoder_reference.json").read_text())
PAIRS = REFERENCE["pairs"]
MODEL = "tiny-reranker"
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reranker")
    write_cross_encoder(directory)
    engine = make_engine(str(directory), EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=64))
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    srv = ServerThread(build_app(async_engine, ServerConfig(served_model_name=MODEL, api_keys=(KEY_A,))))
    yield srv, directory
    snap = wait_until_idle(srv, async_engine)
    assert not snap.has_unfinished and snap.waiting == 0
    assert snap.num_compilations == engine.num_compilations  # nothing compiled while serving
    srv.stop()
    async_engine.shutdown()


@pytest.fixture(scope="module")
def routed_reranker(reranker, _compilation_cache):
    """(router endpoint, worker port): the reranker's directory served by a worker behind a router."""
    flags = ("--api-key", KEY_A, "--served-model-name", MODEL)
    cache = jax.config.jax_compilation_cache_dir
    with worker_behind_router(ENGINE_FLAGS, cache, *flags, model=str(reranker[1])) as (endpoint, port, worker):
        yield endpoint, port
    assert "Traceback" not in worker.output


def _post(srv, path: str, body: dict):
    return send(srv, "POST", path, {"model": MODEL, **body}, key=KEY_A)


def test_the_directory_loads_as_a_cross_encoder(reranker):
    config = load_encoder(str(reranker[1])).config
    assert (config.num_labels, config.pooling, config.sep_token_id, config.score_activation) == (1, "cls", 3, "sigmoid")
    assert not config.normalize


def test_segments_follow_the_first_sep(reranker):
    config = load_encoder(str(reranker[1])).config
    for pair in PAIRS:
        ids = np.array([pair["ids"] + [0, 0]], np.int32)  # padding after the second [SEP] stays segment 1
        assert np.asarray(token_types(config, ids))[0, : len(pair["ids"])].tolist() == pair["type_ids"]


def test_scores_match_sentence_transformers(reranker):
    srv = reranker[0]
    reply = _post(srv, "/v1/score", {"text_1": [p["query"] for p in PAIRS], "text_2": [p["document"] for p in PAIRS]})
    assert reply.status == 200, reply.json
    got = [d["score"] for d in reply.json["data"]]
    np.testing.assert_allclose(got, [p["score"] for p in PAIRS], atol=1e-5)
    assert reply.json["usage"]["prompt_tokens"] == sum(len(p["ids"]) for p in PAIRS)
    # The logits differ by more than the tolerance, so a wrong segment, pooler or head would show.
    assert np.ptp([p["logit"] for p in PAIRS]) > 100 * 1e-5


def test_one_query_against_many_and_rerank(reranker):
    srv = reranker[0]
    query = PAIRS[0]["query"]
    cases = [p for p in PAIRS if p["query"] == query]
    docs = [p["document"] for p in cases]
    scores = [d["score"] for d in _post(srv, "/score", {"text_1": query, "text_2": docs}).json["data"]]
    np.testing.assert_allclose(scores, [p["score"] for p in cases], atol=1e-5)
    reply = _post(srv, "/v1/rerank", {"query": query, "documents": docs, "top_n": 1})
    assert reply.status == 200, reply.json
    best = int(np.argmax(scores))
    assert [r["index"] for r in reply.json["results"]] == [best]
    assert reply.json["results"][0]["document"] == {"text": docs[best]}
    assert math.isclose(reply.json["results"][0]["relevance_score"], scores[best], abs_tol=1e-6)


def test_truncation_shortens_the_second_text(reranker):
    srv = reranker[0]
    long_doc = " ".join(["hello world"] * 40)  # 80 words: over the 64-token limit as a pair
    over = _post(srv, "/v1/score", {"text_1": "cat", "text_2": long_doc})
    assert over.status == 400 and over.json["error"]["code"] == "context_length_exceeded"
    cut = _post(srv, "/v1/score", {"text_1": "cat", "text_2": long_doc, "truncate_prompt_tokens": 16})
    assert cut.status == 200 and cut.json["usage"]["prompt_tokens"] == 16
    first_words = " ".join(["hello world"] * 6)  # what `only_second` truncation to 16 tokens keeps: 12 words
    same = _post(srv, "/v1/score", {"text_1": "cat", "text_2": first_words})
    assert math.isclose(cut.json["data"][0]["score"], same.json["data"][0]["score"], abs_tol=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/embeddings", {"input": "hello"}, "cross-encoder"),
        ("/v1/score", {"text_1": "hello [SEP] world", "text_2": "cat"}, "separator"),
        ("/v1/score", {"text_1": "cat", "text_2": []}, "text_2"),
        ("/v1/rerank", {"query": "cat", "documents": "dog"}, "documents"),
        ("/v1/score", {"text_1": "cat", "text_2": "dog", "truncate_prompt_tokens": 2}, "at most 2"),
    ],
)
def test_bad_input_gets_a_400(reranker, path, body, message):
    reply = _post(reranker[0], path, body)
    assert reply.status == 400 and message in reply.json["error"]["message"], reply.json


def test_the_router_serves_a_cross_encoder_worker(routed_reranker):
    endpoint, port = routed_reranker
    reply = _post(
        endpoint, "/v1/score", {"text_1": [p["query"] for p in PAIRS], "text_2": [p["document"] for p in PAIRS]}
    )
    assert reply.status == 200, reply.json
    np.testing.assert_allclose([d["score"] for d in reply.json["data"]], [p["score"] for p in PAIRS], atol=1e-5)
    ranked = _post(endpoint, "/v1/rerank", {"query": PAIRS[0]["query"], "documents": [PAIRS[0]["document"], "cat"]})
    assert ranked.status == 200 and len(ranked.json["results"]) == 2
    assert _post(endpoint, "/v1/embeddings", {"input": "hello"}).status == 400
    chat = _post(endpoint, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status == 400 and chat.json["error"]["code"] == "model_not_generative"
    snap = wait_idle(port)
    assert not snap.has_unfinished and snap.waiting == 0


def test_other_heads_are_refused(tmp_path):
    write_cross_encoder(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"id2label": {"0": "no", "1": "yes"}}))
    with pytest.raises(UnsupportedCheckpointError, match="2 labels"):
        load_encoder(str(tmp_path))
    activation = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}
    (tmp_path / "config.json").write_text(json.dumps(config | activation))
    with pytest.raises(UnsupportedCheckpointError, match="Tanh"):
        load_encoder(str(tmp_path))
