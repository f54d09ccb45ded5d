"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, with vLLM's request and response
shapes.

Clients count tokens and check context limits with these; they tokenize exactly as the
generation endpoints do (a completion prompt gets the tokenizer's special tokens, a chat is
rendered with the model's template and encoded as written). `/tokenizer_info` is what a client
needs to use the server's tokenizer remotely (lm-eval's `tokenizer_backend=remote`): the fields of
a Hugging Face `tokenizer_config.json`, its special tokens and chat template.
"""

from __future__ import annotations

from aiohttp import web

from server.errors import bad_request
from server.prompts import parse_messages, render_chat
from server.protocol import check_fields, check_model, read_json_object, require_bool
from server.state import STATE

routes = web.RouteTableDef()

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    body = await read_json_object(request)
    check_fields(body, TOKENIZE_FIELDS)
    check_model(body, info.name)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("send exactly one of prompt or messages", param="prompt")
    if "messages" in body:
        text = render_chat(info, parse_messages(body["messages"]), require_bool(body, "add_generation_prompt", True))
        ids = info.tokenizer.encode(text, add_special_tokens=require_bool(body, "add_special_tokens", False))
    else:
        if not isinstance(body["prompt"], str):
            raise bad_request("prompt must be a string", param="prompt")
        ids = info.tokenizer.encode(body["prompt"], add_special_tokens=require_bool(body, "add_special_tokens", True))
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    body = await read_json_object(request)
    check_fields(body, DETOKENIZE_FIELDS)
    check_model(body, info.name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be a list of token ids", param="tokens")
    if tokens and (min(tokens) < 0 or max(tokens) >= info.vocab_size):
        raise bad_request(f"token ids must be in [0, {info.vocab_size})", param="tokens")
    return web.json_response({"prompt": info.tokenizer.decode(tokens, skip_special_tokens=False)})


@routes.get("/tokenizer_info")
async def tokenizer_info(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    tokenizer = info.tokenizer
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
    body = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer.bundle.special_tokens,
        "add_bos_token": adds_bos,
        "model_max_length": info.max_model_len,
    }
    if tokenizer.chat_template is not None:
        body["chat_template"] = tokenizer.chat_template
    return web.json_response(body)
