"""What the engine returns: per-step deltas for streaming, and vLLM-style final outputs."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np


class FinishReason(str, enum.Enum):  # noqa: UP042 (str() of a member is its qualified name, as callers expect)
    STOP = "stop"  # an EOS / stop token id / stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client or by shutdown
    ERROR = "error"


@dataclasses.dataclass
class SampledToken:
    """One token a step sampled, with its log-probability and the best alternatives."""

    token_id: int
    logprob: float
    top_ids: np.ndarray  # [K] int32
    top_logprobs: np.ndarray  # [K] float32


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; empty unless logprobs > 0
    rank: int | None = None  # 1 + how many tokens were more likely (prompt positions only)


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass
class Delta:
    """New output of one sequence (choice `index` of request `request_id`) since the last step."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    usage: Usage | None  # set on the final delta
    error: str | None = None  # with finish_reason "error": what went wrong for this sequence
    # With params.prompt_logprobs: the prompt's scores (None at position 0), once, on the
    # sequence's first delta after its whole prompt is scored.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With `generate(..., hold_kv=True)`, on a final delta that ended by length: the held KV
    # blocks of the prompt (an `engine_client.KVHold`), for a decode worker to pull.
    kv_hold: Any = None
    # With params.pooling, on the final delta: the prompt's pooled final hidden states (float32).
    embedding: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With params.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With params.pooling: the prompt's pooled final hidden states (float32).
    embedding: np.ndarray | None = None
