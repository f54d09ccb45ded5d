"""`GET /openapi.json`: an OpenAPI 3.1 description of every route the app serves.

The paths and methods come from the app's router, so a route cannot be missing; each operation's
summary and request body come from `OPERATIONS`, whose field lists are the ones the handlers accept
(`check_fields`), so the document says what the server takes. Field types are given where a field
means the same on every route (`FIELD_TYPES`); the others are left open (`{}`), as their shapes
vary (`input`, `messages`, `tools`, ...). Errors share OpenAI's error object.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from aiohttp import web

from server.messages_request import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS
from server.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from server.response_request import RESPONSE_FIELDS
from server.routes_embeddings import EMBEDDING_FIELDS
from server.routes_lora import LOAD_FIELDS, UNLOAD_FIELDS
from server.routes_score import RERANK_FIELDS, SCORE_FIELDS
from server.routes_sessions import CREATE_FIELDS, MESSAGE_FIELDS, REPLY_FIELDS
from server.routes_tokenize import DETOKENIZE_FIELDS, TOKENIZE_FIELDS

_STRING, _INTEGER, _NUMBER, _BOOLEAN = ({"type": t} for t in ("string", "integer", "number", "boolean"))
FIELD_TYPES: dict[str, dict[str, Any]] = {
    **dict.fromkeys(
        (
            "model",
            "instructions",
            "previous_response_id",
            "system",
            "user",
            "role",
            "encoding_format",
            "service_tier",
            "safety_identifier",
            "prompt_cache_key",
            "lora_name",
            "lora_path",
        ),
        _STRING,
    ),
    **dict.fromkeys(
        (
            "n",
            "max_tokens",
            "max_completion_tokens",
            "max_output_tokens",
            "min_tokens",
            "top_k",
            "seed",
            "priority",
            "top_logprobs",
            "dimensions",
            "best_of",
            "at",
            "prompt_logprobs",
        ),
        _INTEGER,
    ),
    **dict.fromkeys(
        ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"), _NUMBER
    ),
    **dict.fromkeys(
        (
            "stream",
            "store",
            "background",
            "echo",
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "parallel_tool_calls",
            "add_special_tokens",
            "add_generation_prompt",
        ),
        _BOOLEAN,
    ),
}
# (method, path) -> (summary, accepted body fields or None for no body, required fields)
OPERATIONS: dict[tuple[str, str], tuple[str, frozenset[str] | None, tuple[str, ...]]] = {
    ("POST", "/v1/chat/completions"): ("Chat completion, streamed (SSE) or not", CHAT_FIELDS, ("messages",)),
    ("POST", "/v1/completions"): ("Text completion of a prompt, streamed (SSE) or not", COMPLETION_FIELDS, ("prompt",)),
    ("POST", "/v1/responses"): (
        "Create a response (Responses API): streamed events, one object, or in the background",
        RESPONSE_FIELDS,
        ("input",),
    ),
    ("POST", "/v1/messages"): (
        "Create a message (Anthropic's Messages API), streamed (SSE events) or not",
        MESSAGES_FIELDS,
        ("max_tokens", "messages"),
    ),
    ("POST", "/v1/messages/count_tokens"): (
        "The prompt tokens of a Messages API request (Anthropic's count_tokens)",
        COUNT_TOKENS_FIELDS,
        ("messages",),
    ),
    ("GET", "/v1/responses/{response_id}"): ("A stored response", None, ()),
    ("DELETE", "/v1/responses/{response_id}"): ("Delete a stored response", None, ()),
    ("POST", "/v1/responses/{response_id}/cancel"): ("Cancel a background response", None, ()),
    ("GET", "/v1/responses/{response_id}/input_items"): (
        "A stored response's input items (limit, order, after, before)",
        None,
        (),
    ),
    ("POST", "/v1/embeddings"): ("Embeddings of texts or token ids", EMBEDDING_FIELDS, ("input",)),
    ("POST", "/v1/score"): ("Cosine scores of text pairs (embedding models)", SCORE_FIELDS, ("text_1", "text_2")),
    ("POST", "/score"): ("vLLM's name for /v1/score", SCORE_FIELDS, ("text_1", "text_2")),
    ("POST", "/v1/rerank"): (
        "Documents ranked by a query (embedding models)",
        RERANK_FIELDS,
        ("query", "documents"),
    ),
    ("POST", "/rerank"): ("vLLM's name for /v1/rerank", RERANK_FIELDS, ("query", "documents")),
    ("POST", "/v2/rerank"): ("vLLM's name for /v1/rerank", RERANK_FIELDS, ("query", "documents")),
    ("GET", "/v1/models"): ("The served model and its LoRA adapters", None, ()),
    ("POST", "/v1/load_lora_adapter"): (
        "Serve a LoRA adapter (a PEFT directory) as a model",
        LOAD_FIELDS,
        ("lora_name", "lora_path"),
    ),
    ("POST", "/v1/unload_lora_adapter"): ("Stop serving a LoRA adapter", UNLOAD_FIELDS, ("lora_name",)),
    ("GET", "/v1/models/{model}"): ("One model", None, ()),
    ("POST", "/v1/sessions"): ("Create a session", CREATE_FIELDS, ()),
    ("GET", "/v1/sessions"): ("The caller's sessions", None, ()),
    ("GET", "/v1/sessions/{session_id}"): ("One session with its messages", None, ()),
    ("DELETE", "/v1/sessions/{session_id}"): ("Delete a session", None, ()),
    ("POST", "/v1/sessions/{session_id}/messages"): (
        "Add a user message and generate the reply",
        MESSAGE_FIELDS,
        ("content",),
    ),
    ("PUT", "/v1/sessions/{session_id}/messages/{index}"): (
        "Edit a message (and regenerate the reply)",
        MESSAGE_FIELDS,
        ("content",),
    ),
    ("POST", "/v1/sessions/{session_id}/fork"): ("A new session with the first messages", frozenset({"at"}), ()),
    ("POST", "/v1/sessions/{session_id}/cancel"): ("Stop the reply in flight", None, ()),
    ("POST", "/v1/sessions/{session_id}/continue"): ("Generate more of the last assistant message", REPLY_FIELDS, ()),
    ("POST", "/tokenize"): ("Token ids of a prompt or a chat", TOKENIZE_FIELDS, ()),
    ("POST", "/detokenize"): ("Text of token ids", DETOKENIZE_FIELDS, ("tokens",)),
    ("GET", "/tokenizer_info"): ("The tokenizer's configuration, special tokens and chat template", None, ()),
    ("GET", "/health"): ("Whether the engine serves (no key needed)", None, ()),
    ("GET", "/metrics"): ("Prometheus metrics (no key needed)", None, ()),
    ("GET", "/openapi.json"): ("This document (no key needed)", None, ()),
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": _STRING,
                "type": _STRING,
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


routes = web.RouteTableDef()


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    try:
        version = importlib.metadata.version("jaxserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return web.json_response(document(request.app, "jaxserve", version))


def document(app: web.Application, title: str, version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        path = route.resource.canonical
        paths.setdefault(path, {})[route.method.lower()] = _operation(route.method, path)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": {"Error": ERROR}},
    }


def _operation(method: str, path: str) -> dict[str, Any]:
    summary, fields, required = OPERATIONS.get((method, path), ("", None, ()))
    operation: dict[str, Any] = {
        "summary": summary,
        "operationId": method.lower() + path.replace("/", "_").replace("{", "").replace("}", ""),
        "responses": {
            "200": {"description": "OK"},
            "default": {
                "description": "An error",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    }
    parameters = [
        {"name": part[1:-1], "in": "path", "required": True, "schema": _STRING}
        for part in path.split("/")
        if part.startswith("{")
    ]
    if parameters:
        operation["parameters"] = parameters
    if fields is not None:
        schema = {
            "type": "object",
            "additionalProperties": False,
            "properties": {name: FIELD_TYPES.get(name, {}) for name in sorted(fields)},
        }
        if required:
            schema["required"] = list(required)
        operation["requestBody"] = {"required": bool(required), "content": {"application/json": {"schema": schema}}}
    return operation
