"""`POST /v1/score` and `/v1/rerank` (and vLLM's unversioned `/score`, `/rerank`, `/v2/rerank`):
vLLM's request and response shapes. An embedding model (a bi-encoder) scores a pair by the cosine
similarity of the two embeddings; a cross-encoder reads the pair as one input and scores it with its
classifier head (its logit through sentence-transformers' activation, a sigmoid by default), as
vLLM does for both kinds.

Score: `text_1` and `text_2` are strings or lists of strings; one against many, or pairwise when
both are lists of the same length. Rerank: a `query` and `documents`, sorted by relevance,
`top_n` kept. Every text (a cross-encoder: every pair) runs in one batch through the engine
(`pooled_vectors`).
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from server.auth import OWNER_KEY
from server.embedding_inputs import MAX_INPUTS, pair_ids, text_ids, truncation
from server.errors import bad_request
from server.protocol import check_fields, check_model, read_json_object
from server.routes_embeddings import finished, pooled_vectors
from server.state import STATE, ServerState

routes = web.RouteTableDef()

SCORE_FIELDS = frozenset({"model", "text_1", "text_2", "truncate_prompt_tokens", "user"})
RERANK_FIELDS = frozenset(
    {"model", "query", "documents", "top_n", "return_documents", "truncate_prompt_tokens", "user"}
)


def _texts(body: dict[str, Any], field: str, single_ok: bool = True) -> list[str]:
    value = body.get(field)
    if isinstance(value, str) and single_ok:
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        kinds = "a string or a non-empty list of strings" if single_ok else "a non-empty list of strings"
        raise bad_request(f"{field} must be {kinds}", param=field)
    if len(value) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} texts in {field}", param=field)
    return value


async def _scores(
    state: ServerState, request: web.Request, body: dict[str, Any], queries: list[str], docs: list[str], endpoint: str
) -> tuple[list[float], int]:
    """The score of each pair (query i, doc i) (a single query is paired with every doc)."""
    arrival = time.perf_counter()
    state.limiter.admit(request[OWNER_KEY])
    encoder = state.info.encoder
    if encoder is None:
        raise bad_request(f"/v1/{endpoint} needs an embedding model; {state.info.name} is a text-generation model")
    keep = truncation(body, state.info)
    pairs = list(zip(queries * len(docs) if len(queries) == 1 else queries, docs))
    if encoder.is_cross_encoder:
        ids = [pair_ids(a, b, state.info, keep) for a, b in pairs]
        logits, prompt_tokens = await pooled_vectors(state, request, ids, endpoint, arrival)
        return [_activated(float(v[0]), encoder.score_activation) for v in logits], prompt_tokens
    ids = [text_ids(t, state.info, endpoint, keep) for t in (*queries, *docs)]
    vectors, prompt_tokens = await pooled_vectors(state, request, ids, endpoint, arrival)
    unit = [finished(state, v) for v in vectors]
    unit = [v / max(float(np.linalg.norm(v)), 1e-12) for v in unit]
    q, d = unit[: len(queries)], unit[len(queries) :]
    return [float(np.dot(a, b)) for a, b in zip(q * len(d) if len(q) == 1 else q, d)], prompt_tokens


def _activated(logit: float, activation: str) -> float:
    return 1.0 / (1.0 + math.exp(-logit)) if activation == "sigmoid" else logit


@routes.post("/v1/score")
@routes.post("/score")
async def score(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    check_fields(body, SCORE_FIELDS)
    check_model(body, state.info.name)
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    if len(first) > 1 and len(first) != len(second):
        raise bad_request("text_1 is a list: text_2 must be a list of the same length", param="text_2")
    scores, tokens = await _scores(state, request, body, first, second, "score")
    return web.json_response(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.info.name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


@routes.post("/v1/rerank")
@routes.post("/rerank")
@routes.post("/v2/rerank")
async def rerank(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json_object(request)
    check_fields(body, RERANK_FIELDS)
    check_model(body, state.info.name)
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("query must be a string", param="query")
    documents = _texts(body, "documents", single_ok=False)
    top_n = body.get("top_n", len(documents))
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise bad_request("top_n must be a non-negative integer", param="top_n")
    scores, tokens = await _scores(state, request, body, [query], documents, "rerank")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: top_n or len(documents)]
    with_text = body.get("return_documents", True) is not False
    results = [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}} if with_text else {})}
        for i in order
    ]
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.info.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
    )
