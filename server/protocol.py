"""Request bodies -> validated settings: JSON reading, field checks, `SamplingParams`.

OpenAI's rules where they exist: unknown fields are refused (400, naming the field), `null`
means "not given", and every wrong value is a 400 that names its parameter. vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ...) are accepted too, and so are structured
output's `response_format` and vLLM's `guided_*` extras. Fields that the API defines but this
server cannot honour (audio, prediction, ...) are accepted only at their neutral value.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection
from typing import Any

from aiohttp import web

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.structured.spec import GuidedDecoding
from jaxserve.structured.strict import strict_schema
from server.errors import APIError, bad_request
from server.json_body import JSONBodyError, parse_json

SAMPLING_FIELDS = frozenset(
    {
        "n",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "seed",
        "priority",
        "skip_special_tokens",
        "logit_bias",
        "include_stop_str_in_output",
        "prompt_logprobs",
    }
)
# Structured output: OpenAI's response_format and vLLM's extras (at most one of them).
GUIDED_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"})
TOOL_FIELDS = frozenset({"tools", "tool_choice"})
TEMPLATE_FIELDS = frozenset({"chat_template_kwargs"})  # vLLM's extra template variables
# Accepted and ignored: they describe the caller, not the generation.
METADATA_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
STREAM_FIELDS = frozenset({"stream", "stream_options"})
CHAT_LOGPROB_FIELDS = frozenset({"logprobs", "top_logprobs", "max_completion_tokens"})
# Fields this server does not implement, with the values that mean "not used".
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "suffix": ("",),
}
CHAT_FIELDS = (
    frozenset({"model", "messages"})
    | SAMPLING_FIELDS
    | METADATA_FIELDS
    | STREAM_FIELDS
    | CHAT_LOGPROB_FIELDS
    | GUIDED_FIELDS
    | TOOL_FIELDS
    | TEMPLATE_FIELDS
    | (frozenset(NEUTRAL_VALUES) - {"suffix"})
)
COMPLETION_FIELDS = (
    frozenset({"model", "prompt", "logprobs", "best_of", "echo", "suffix"})
    | SAMPLING_FIELDS
    | METADATA_FIELDS
    | STREAM_FIELDS
    | GUIDED_FIELDS
)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


BODY_TIMEOUT = web.AppKey("body_timeout", float)  # seconds a client may take to send its body


async def read_json_object(request: web.Request, optional: bool = False) -> dict[str, Any]:
    """The body as a JSON object, or 400 (413 comes from aiohttp when it is too large; 408 when
    the client stalls). With `optional`, an empty body is an empty object."""
    try:
        raw = await asyncio.wait_for(request.read(), request.config_dict.get(BODY_TIMEOUT))
    except TimeoutError:
        raise APIError(
            408, "the request body did not arrive in time", code="request_timeout", headers={"Connection": "close"}
        ) from None
    if not raw.strip():
        if optional:
            return {}
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = parse_json(raw)
    except JSONBodyError as e:
        raise bad_request(f"could not parse the JSON body of the request: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the JSON body must be an object")
    return {k: v for k, v in body.items() if v is not None}  # null = not given


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed:
            raise bad_request(f"unrecognized request argument supplied: {name}", param=name, code="unknown_field")
    for name, neutral in NEUTRAL_VALUES.items():
        if name in body and body[name] not in neutral:
            raise bad_request(f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def require_str(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string", param=name)
    return value


def require_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field (`null` means not given), or 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", param=name)
    return value


def check_model(body: dict[str, Any], served_name: str, adapters: Collection[str] = ()) -> str:
    """The requested model: the served one (the default) or one of its LoRA `adapters`; else 404."""
    model = require_str(body, "model", served_name)
    if model != served_name and model not in adapters:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {served_name!r}"
            + (f" and its LoRA adapters {sorted(adapters)}" if adapters else ""),
            param="model",
            code="model_not_found",
        )
    return model


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    stream: bool
    include_usage: bool


def parse_stream(body: dict[str, Any]) -> StreamOptions:
    stream = require_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(stream, False)
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise bad_request("stream_options must be an object with include_usage", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be a boolean", param="stream_options")
    return StreamOptions(True, include_usage)


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_tokens_limit: int
    max_n: int


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise bad_request(f"{name} must be an integer", param=name)
    return value


def logprobs_setting(body: dict[str, Any], chat: bool) -> int | None:
    """SamplingParams.logprobs from the chat (`logprobs` bool + `top_logprobs`) or the
    completions (`logprobs` int) style."""
    if chat:
        wanted = require_bool(body, "logprobs", False)
        top = _int_field(body, "top_logprobs")
        if top is not None and not wanted:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        return (top or 0) if wanted else None
    top = _int_field(body, "logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    return top


def max_tokens_setting(body: dict[str, Any], limits: Limits, longest_prompt: int, default: int | None) -> int:
    """max_tokens (or max_completion_tokens), checked against the limit and the context.

    Given explicitly, prompt + max_tokens must fit the context (as in vLLM); when absent, the
    default is capped to what fits.
    """
    given = _int_field(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if given is None:
        given, name = _int_field(body, "max_tokens"), "max_tokens"
    room = limits.max_model_len - longest_prompt
    if given is None:
        cap = min(limits.max_tokens_limit, room)
        return max(1, cap if default is None else min(default, cap))
    if given < 1:
        raise bad_request(f"{name} must be at least 1, got {given}", param=name)
    if given > limits.max_tokens_limit:
        raise bad_request(f"{name} must be at most {limits.max_tokens_limit}, got {given}", param=name)
    if given > room:
        raise bad_request(
            f"this model's maximum context length is {limits.max_model_len} tokens; the request asks for "
            f"{longest_prompt + given} ({longest_prompt} in the prompt, {given} to generate)",
            param=name,
            code="context_length_exceeded",
        )
    return given


def guided_setting(body: dict[str, Any], strict: bool = True) -> GuidedDecoding | None:
    """The structured-output constraint of `response_format` or a `guided_*` field (at most one);
    400 naming the field and the problem when it is malformed or the grammar library rejects it.
    With `strict` (the server's default; `json_schema.strict: false` opts out), objects hold only
    the properties their schema lists unless it allows more (`strict_schema`)."""
    given = {name: body[name] for name in GUIDED_FIELDS if name in body}
    if given.get("response_format") == {"type": "text"}:
        del given["response_format"]
    if len(given) > 1:
        raise bad_request(f"at most one of {sorted(given)} may be given", param=sorted(given)[1])
    if not given:
        return None
    ((name, value),) = given.items()
    try:
        if name == "response_format":
            return _response_format(value, strict)
        if name == "guided_json":
            schema = _json_value(value, name)
            return GuidedDecoding("json", strict_schema(schema) if strict else schema)
        return GuidedDecoding(
            {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}[name], value
        )
    except ValueError as e:
        raise bad_request(f"{name}: {e}", param=name, code="invalid_schema") from None


def _response_format(value: Any, strict: bool) -> GuidedDecoding:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object" and set(value) == {"type"}:
        return GuidedDecoding("json_object")
    if kind == "json_schema" and set(value) == {"type", "json_schema"} and isinstance(value["json_schema"], dict):
        spec = value["json_schema"]
        if set(spec) - {"name", "description", "schema", "strict"}:
            raise ValueError(
                f"json_schema has unsupported fields: {sorted(set(spec) - {'name', 'description', 'schema', 'strict'})}"
            )
        if "name" in spec and not isinstance(spec["name"], str):
            raise ValueError("json_schema.name must be a string")
        if "strict" in spec and not isinstance(spec["strict"], bool):
            raise ValueError("json_schema.strict must be a boolean")
        if "schema" not in spec:
            return GuidedDecoding("json_object")
        return GuidedDecoding("json", strict_schema(spec["schema"]) if spec.get("strict", strict) else spec["schema"])
    raise ValueError(
        'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
        '{"name": ..., "schema": {...}}}'
    )


def _json_value(value: Any, name: str) -> Any:
    """vLLM's guided_json: a schema object, or the schema as JSON text."""
    if isinstance(value, str):
        try:
            return parse_json(value.encode("utf-8"))
        except JSONBodyError as e:
            raise ValueError(f"the schema is not valid JSON: {e}") from None
    return value


def build_sampling_params(
    body: dict[str, Any],
    *,
    max_tokens: int,
    logprobs: int | None,
    max_n: int,
    vocab_size: int,
    guided: GuidedDecoding | None = None,
    echo: bool = False,
    strict_schemas: bool = True,
) -> SamplingParams:
    """The request's SamplingParams; `guided` (a tool call to enforce) replaces the body's
    structured-output fields, which may not be given with it. With `echo` and `logprobs`
    (completions), the prompt is scored too (prompt_logprobs defaults to logprobs)."""
    given = guided_setting(body, strict_schemas)
    if guided is not None and given is not None:
        raise bad_request(
            "a required or named tool_choice cannot be combined with structured output fields", param="tool_choice"
        )
    guided = guided or given
    fields = {name: body[name] for name in SAMPLING_FIELDS - {"max_tokens"} if name in body}
    if echo and logprobs is not None:
        fields.setdefault("prompt_logprobs", logprobs)
    n = fields.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {n}", param="n")
    if isinstance(fields.get("logit_bias"), dict):
        fields["logit_bias"] = _token_id_keys(fields["logit_bias"])
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, guided=guided, **fields)
        params.check_vocabulary(vocab_size)
        return params
    except (ValueError, TypeError) as e:
        message = str(e)
        first = message.split(" ", 1)[0]
        raise bad_request(message, param=first if first in SAMPLING_FIELDS else None) from None


def _token_id_keys(bias: dict[str, Any]) -> dict[int, Any]:
    """JSON object keys are strings: {"50256": -100} -> {50256: -100}."""
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None


def echo_setting(body: dict[str, Any]) -> bool:
    """Completions' `echo`: return the prompt before the completion (with `logprobs`, the
    prompt tokens' log-probabilities before the completion's, as lm-eval-harness reads them)."""
    return require_bool(body, "echo", False)


def check_best_of(body: dict[str, Any]) -> None:
    best_of = _int_field(body, "best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad_request("best_of different from n is not supported", param="best_of", code="unsupported_parameter")
