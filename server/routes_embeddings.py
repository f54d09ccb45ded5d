"""`POST /v1/embeddings`: OpenAI's embeddings of texts or token ids, from the served model's hidden
states.

Each input is one engine request that pools its prompt's final hidden states (after the model's
final norm) and generates nothing (`SamplingParams.for_pooling`): the last token's, or the mean of
every token's, as `--embedding-pooling` says for the served model; the vector is then normalized
to unit length. The inputs of a request share the engine's prefill steps with each other and with
other requests, and the prefix cache (a last-token embedding of a cached prompt computes only its
last block). Texts get what the tokenizer adds, as completion prompts do.
"""

from __future__ import annotations

import base64
import time
import uuid
from contextlib import aclosing
from typing import Any

import numpy as np
from aiohttp import web

from jaxserve.sampling_params import SamplingParams
from server.auth import OWNER_KEY
from server.errors import APIError, bad_request
from server.generation import EngineRequest
from server.model_info import ModelInfo
from server.prompts import prompt_ids_or_400
from server.protocol import check_fields, check_model, read_json_object
from server.state import STATE

routes = web.RouteTableDef()

EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request
ENCODINGS = ("float", "base64")


def embedding_inputs(body: dict[str, Any], info: ModelInfo) -> list[list[int]]:
    """`input` as a string, a list of strings, a list of token ids, or a list of such lists: each
    input's token ids, checked (400 naming `input` otherwise)."""
    if "input" not in body:
        raise bad_request("input is required", param="input")
    value = body["input"]
    if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(
            "input must be a string, a list of strings, a list of token ids, or a list of token id "
            "lists, and not empty",
            param="input",
        )
    if len(value) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request", param="input")
    inputs = []
    for item in value:
        if isinstance(item, str):
            ids = info.tokenizer.encode(item, add_special_tokens=True) if item else []
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            ids = item
        else:
            raise bad_request(
                "input must be a string, a list of strings, a list of token ids, or a list of token id "
                "lists, not a mix",
                param="input",
            )
        inputs.append(prompt_ids_or_400(ids, info, "input"))
    return inputs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encoding(body: dict[str, Any], hidden_size: int) -> str:
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise bad_request(f"encoding_format must be one of {list(ENCODINGS)}", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions != hidden_size):
        raise bad_request(
            f"dimensions: this model's embeddings have {hidden_size} dimensions, and it cannot shorten "
            f"them (it was not trained to); leave dimensions out or give {hidden_size}",
            param="dimensions",
            code="unsupported_parameter",
        )
    return encoding


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """The vector at unit length, as floats or as base64 of little-endian float32 (OpenAI's)."""
    unit = vector / max(float(np.linalg.norm(vector)), 1e-12)
    if encoding == "base64":
        return base64.b64encode(unit.astype("<f4").tobytes()).decode("ascii")
    return unit.astype(np.float32).tolist()


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    arrival = time.perf_counter()
    state = request.app[STATE]
    state.limiter.admit(request[OWNER_KEY])
    body = await read_json_object(request)
    check_fields(body, EMBEDDING_FIELDS)
    check_model(body, state.info.name)
    encoding = _encoding(body, state.info.hidden_size)
    inputs = embedding_inputs(body, state.info)
    params = SamplingParams.for_pooling(state.config.embedding_pooling)
    request_id = f"embd-{uuid.uuid4().hex}"
    requests = [EngineRequest(f"{request_id}-{i}", ids, params, i) for i, ids in enumerate(inputs)]
    vectors: list[np.ndarray | None] = [None] * len(inputs)
    with state.admission.hold(len(inputs)):
        generation = state.generation(request, requests, "embeddings", arrival)
        async with aclosing(generation.deltas()) as deltas:
            async for index, delta in deltas:
                if delta.embedding is not None:
                    vectors[index] = delta.embedding
    if any(v is None for v in vectors):
        raise APIError(500, "the engine ended an input without its embedding", code="internal_error")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)} for i, v in enumerate(vectors)]
    usage = generation.usage
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": state.info.name,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        }
    )
