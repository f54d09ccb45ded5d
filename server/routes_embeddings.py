"""`POST /v1/embeddings`: OpenAI's embeddings of texts or token ids.

Each input is one engine request that pools its prompt's final hidden states and generates
nothing (`SamplingParams.for_pooling`), batched with other requests by the engine's steps. Which
rows are pooled is the model's `jaxserve.pooling.Pooler`: for a decoder LM the last token's or the
mean (`--embedding-pooling`, after the final norm); for an encoder embedding model (BERT family)
its own (sentence-transformers' pooling config). Vectors are then finished by
`embedding_inputs.finish_embedding`: shortened to `dimensions` where the model allows it (Matryoshka),
and at unit length (a decoder LM's always; an encoder's when its config normalises). A decoder LM
shares the prefix cache (a last-token embedding of a cached prompt computes only its last block).
Texts get what the tokenizer adds, as completion prompts do ([CLS] ... [SEP] for BERT).
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing

import numpy as np
from aiohttp import web

from jaxserve.sampling_params import SamplingParams
from server.auth import OWNER_KEY
from server.embedding_inputs import dimensions, embedding_inputs, encoded, encoding, finish_embedding
from server.errors import APIError, bad_request
from server.generation import EngineRequest
from server.protocol import check_fields, check_model, read_json_object
from server.state import STATE, ServerState

routes = web.RouteTableDef()

EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"})


async def pooled_vectors(
    state: ServerState, request: web.Request, inputs: list[list[int]], endpoint: str, arrival: float
) -> tuple[list[np.ndarray], int]:
    """Each input's pooled vector (not finished) through the engine, and the prompt tokens used."""
    kind = state.config.embedding_pooling if state.info.encoder is None else state.info.encoder.pooling
    params = SamplingParams.for_pooling(kind)
    request_id = f"embd-{uuid.uuid4().hex}"
    requests = [EngineRequest(f"{request_id}-{i}", ids, params, i) for i, ids in enumerate(inputs)]
    vectors: list[np.ndarray | None] = [None] * len(inputs)
    with state.admission.hold(len(inputs)):
        generation = state.generation(request, requests, endpoint, arrival)
        async with aclosing(generation.deltas()) as deltas:
            async for index, delta in deltas:
                if delta.embedding is not None:
                    vectors[index] = delta.embedding
    if any(v is None for v in vectors):
        raise APIError(500, "the engine ended an input without its embedding", code="internal_error")
    return vectors, generation.usage.prompt_tokens


def finished(state: ServerState, vector: np.ndarray, size: int | None = None) -> np.ndarray:
    """A pooled vector as served (see `embedding_inputs.finish_embedding`)."""
    encoder = state.info.encoder
    return finish_embedding(vector, normalize=encoder is None or encoder.normalize, dimensions=size)


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    arrival = time.perf_counter()
    state = request.app[STATE]
    state.limiter.admit(request[OWNER_KEY])
    body = await read_json_object(request)
    check_fields(body, EMBEDDING_FIELDS)
    check_model(body, state.info.name)
    if state.info.encoder is not None and state.info.encoder.is_cross_encoder:
        raise bad_request(f"{state.info.name} is a cross-encoder: it scores pairs of texts (/v1/score, /v1/rerank)")
    fmt, size = encoding(body), dimensions(body, state.info)
    inputs = embedding_inputs(body, state.info)
    vectors, prompt_tokens = await pooled_vectors(state, request, inputs, "embeddings", arrival)
    data = [
        {"object": "embedding", "index": i, "embedding": encoded(finished(state, v, size), fmt)}
        for i, v in enumerate(vectors)
    ]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": state.info.name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
