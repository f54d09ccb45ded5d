"""Multi-step decode (`num_scheduler_steps` K > 1): how many tokens one decode may sample in a device loop."""

from __future__ import annotations

from jaxserve.request import Request


def decode_loop_steps(req: Request, num_scheduler_steps: int, max_model_len: int) -> int:
    """Decode steps the request may take in one device loop: at most `num_scheduler_steps`, not past its
    length limits, and not across its `min_tokens` (the loop bans its stop tokens throughout, or never)."""
    out = len(req.output_token_ids)
    steps = 1
    limit = num_scheduler_steps
    if out < req.params.min_tokens:
        limit = min(limit, req.params.min_tokens - out)
    while steps < limit and not req.ends_by_length(out + steps, max_model_len):
        steps += 1
    return steps
