"""nomic-embed-text-v1.5 (GGUF `nomic-bert`, fetched by its registry name: ~377 MB of wheels)
served, against llama.cpp's embeddings of the same file (tests/data/nomic_golden.json, made by
tests/data/make_nomic_golden.py). Slow tier: the download and a 137M-parameter model."""

from __future__ import annotations

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

pytestmark = pytest.mark.slow

MODEL = "nomic-embed-text-v1.5"
GOLDEN_FILE = Path(__file__).parent.parent / "data" / "nomic_golden.json"


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def nomic():
    engine = make_engine(MODEL, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64))
    engine.warm_up()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    srv = ServerThread(build_app(async_engine, ServerConfig(served_model_name=MODEL, api_keys=(KEY_A,))))
    yield srv
    snap = wait_until_idle(srv, async_engine)
    assert not snap.has_unfinished and snap.num_compilations == engine.num_compilations
    srv.stop()
    async_engine.shutdown()


def test_nomic_matches_llama_cpp(nomic, golden):
    client = openai.OpenAI(base_url=nomic.base_url + "/v1", api_key=KEY_A, max_retries=0)
    ids = [send(nomic, "POST", "/tokenize", {"prompt": t}).json["tokens"] for t in golden["texts"]]
    assert ids == golden["token_ids"]  # the WordPiece rebuilt from the GGUF tokenizes as llama.cpp does
    reply = client.embeddings.create(model=MODEL, input=golden["texts"])
    for got, want, text in zip(reply.data, golden["vectors"], golden["texts"]):
        got, want = np.asarray(got.embedding), np.asarray(want)
        assert got.shape == (768,)
        # llama.cpp multiplies in f16 (measured: cosine distance <= 5.1e-7, values within 1.4e-4)
        assert 1.0 - got @ want < 1e-5, text
    query, relevant, unrelated = (np.asarray(d.embedding) for d in reply.data[:3])
    assert query @ relevant > query @ unrelated + 0.2


def test_nomic_shortens_its_embeddings(nomic, golden):
    client = openai.OpenAI(base_url=nomic.base_url + "/v1", api_key=KEY_A, max_retries=0)
    full = np.asarray(client.embeddings.create(model=MODEL, input=golden["texts"][0]).data[0].embedding)
    short = np.asarray(
        client.embeddings.create(model=MODEL, input=golden["texts"][0], dimensions=256).data[0].embedding
    )
    assert short.shape == (256,)
    np.testing.assert_allclose(np.linalg.norm(short), 1.0, rtol=1e-5)
    assert 1.0 - short @ (full[:256] - full.mean()) / np.linalg.norm(full[:256] - full.mean()) < 1e-5
    too_many = send(nomic, "POST", "/v1/embeddings", {"input": "x", "dimensions": 769})
    assert too_many.status == 400 and too_many.json["error"]["param"] == "dimensions"
