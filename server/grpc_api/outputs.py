"""Engine deltas and usage counts -> `GenerateResponse` messages."""

from __future__ import annotations

from jaxserve.outputs import Delta, TokenLogprob
from server.grpc_api import jaxserve_pb2 as pb
from server.openai_bodies import UsageCount


def _logprob(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top],
    )


def response_message(request_id: str, index: int, delta: Delta) -> pb.GenerateResponse:
    """Choice `index`'s new output (its finish reason is "" while it runs)."""
    return pb.GenerateResponse(
        request_id=request_id,
        index=index,
        text=delta.text,
        token_ids=delta.token_ids,
        logprobs=[_logprob(e) for e in delta.logprobs or ()],
        finish_reason=delta.finish_reason or "",
    )


def usage_message(usage: UsageCount) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )
