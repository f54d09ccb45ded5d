"""What `/v1/embeddings`, `/v1/score` and `/v1/rerank` read from a request: inputs as token ids
(checked against the served model's limits), the embedding's encoding and length."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from server.errors import bad_request
from server.model_info import ModelInfo
from server.prompts import prompt_ids_or_400

MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request
ENCODINGS = ("float", "base64")
INPUT_KINDS = "a string, a list of strings, a list of token ids, or a list of token id lists"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def truncation(body: dict[str, Any], info: ModelInfo) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep at most this many tokens of each input (-1: the
    model's limit); None: an over-long input is refused."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return None
    limit = max_input_tokens(info)
    if not is_int(value) or not (value == -1 or 1 <= value <= limit):
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {limit}]", param="truncate_prompt_tokens")
    return limit if value == -1 else value


def max_input_tokens(info: ModelInfo) -> int:
    """An encoder takes inputs of up to its max length; a decoder LM leaves one position to generate."""
    return info.max_model_len if info.encoder is not None else info.max_model_len - 1


def _truncated(ids: list[int], keep: int | None, info: ModelInfo) -> list[int]:
    """An encoder keeps the start and its closing special token ([SEP]); a decoder LM keeps the
    last tokens (as vLLM does)."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[: keep - 1] + ids[-1:] if info.encoder is not None else ids[-keep:]


def checked_ids(ids: list[int], info: ModelInfo, param: str, keep: int | None = None) -> list[int]:
    ids = _truncated(ids, keep, info)
    if info.encoder is None:
        return prompt_ids_or_400(ids, info, param)
    if not ids:
        raise bad_request(f"{param}: an input is empty", param=param)
    if min(ids) < 0 or max(ids) >= info.vocab_size:
        raise bad_request(f"{param}: token ids must be in [0, {info.vocab_size})", param=param)
    if len(ids) > info.max_model_len:
        raise bad_request(
            f"{param}: an input has {len(ids)} tokens and this model takes at most {info.max_model_len} "
            "(or set truncate_prompt_tokens)",
            param=param,
            code="context_length_exceeded",
        )
    return ids


def pair_ids(first: str, second: str, info: ModelInfo, keep: int | None = None) -> list[int]:
    """A cross-encoder's input: `[CLS] first [SEP] second [SEP]` (the tokenizer's pair template). Truncation
    shortens the second text only (Hugging Face's `only_second`). The first text may not hold the [SEP]
    token itself: the model reads every token after the first [SEP] as the second text's."""
    head, tail = info.tokenizer.encode_pair(first, second)
    if head.count(info.encoder.sep_token_id) != 1:
        raise bad_request("a text to score may not contain the separator token [SEP]", param="text_1")
    limit = keep or info.max_model_len
    if len(head) + len(tail) > limit:
        if keep is None or len(head) + 1 >= keep:
            code = "context_length_exceeded"
            message = f"a pair has {len(head) + len(tail)} tokens and this model takes at most {limit}"
            raise bad_request(message + (" (or set truncate_prompt_tokens)" if keep is None else ""), code=code)
        tail = tail[: keep - len(head) - 1] + tail[-1:]
    return checked_ids(head + tail, info, "text_2")


def text_ids(text: str, info: ModelInfo, param: str, keep: int | None = None) -> list[int]:
    return checked_ids(info.tokenizer.encode(text, add_special_tokens=True) if text else [], info, param, keep)


def embedding_inputs(body: dict[str, Any], info: ModelInfo) -> list[list[int]]:
    """`input` as a string, a list of strings, a list of token ids, or a list of such lists: each
    input's token ids, checked (400 naming `input` otherwise)."""
    if "input" not in body:
        raise bad_request("input is required", param="input")
    value = body["input"]
    if isinstance(value, str) or (isinstance(value, list) and value and is_int(value[0])):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"input must be {INPUT_KINDS}, and not empty", param="input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request", param="input")
    keep = truncation(body, info)
    inputs = []
    for item in value:
        if isinstance(item, str):
            inputs.append(text_ids(item, info, "input", keep))
        elif isinstance(item, list) and all(is_int(t) for t in item):
            inputs.append(checked_ids(item, info, "input", keep))
        else:
            raise bad_request(f"input must be {INPUT_KINDS}, not a mix", param="input")
    return inputs


def dimensions(body: dict[str, Any], info: ModelInfo) -> int | None:
    """`dimensions`: a Matryoshka model's embeddings may be shortened; others keep their length."""
    value = body.get("dimensions")
    if value is None:
        return None
    full = info.hidden_size
    if info.encoder is not None and info.encoder.matryoshka:
        if not is_int(value) or not 1 <= value <= full:
            raise bad_request(f"dimensions must be an integer in [1, {full}]", param="dimensions")
        return value
    if not is_int(value) or value != full:
        raise bad_request(
            f"dimensions: this model's embeddings have {full} dimensions, and it cannot shorten "
            f"them (it was not trained to); leave dimensions out or give {full}",
            param="dimensions",
            code="unsupported_parameter",
        )
    return None


def encoding(body: dict[str, Any]) -> str:
    value = body.get("encoding_format", "float")
    if value not in ENCODINGS:
        raise bad_request(f"encoding_format must be one of {list(ENCODINGS)}", param="encoding_format")
    return value


def encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    """As floats, or as base64 of little-endian float32 (OpenAI's)."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32).tolist()


def finish_embedding(vector: np.ndarray, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    """A pooled vector as served: shortened to its first `dimensions` (Matryoshka: after a layer
    norm without scale over the full vector, as nomic-embed's recipe has it), then at unit length
    when the model's embeddings are normalised."""
    vector = vector.astype(np.float64)
    if dimensions is not None and dimensions < vector.shape[-1]:
        vector = (vector - vector.mean()) / np.sqrt(vector.var() + 1e-5)
        vector = vector[:dimensions]
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)
