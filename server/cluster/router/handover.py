"""Prefill/decode disaggregation as the router plans it: which requests split, and the two halves.

A split request runs on a prefill worker with max_tokens = 1 (its one token is the request's first
output token) and `hold_kv`; the decode worker then gets the prompt with that token appended, the
rest of the budget, and the lease to pull the prompt's KV from. The sampler keys a seeded draw by
its position in the whole sequence and the repetition penalty counts prompt and output alike,
so the decode worker samples what one worker would; presence and frequency penalties count the
output only and a grammar follows it, so those requests are not split (one worker runs them).

The same holds for a sequence whose worker failed after it streamed part of it (`resumes`): another
worker finishes it from the prompt plus the tokens streamed so far (`decode_params` of the rest),
recomputing their KV, and samples what the first worker would have.
"""

from __future__ import annotations

import dataclasses

from jaxserve.sampling_params import SamplingParams


def resumes(params: SamplingParams) -> bool:
    """Whether another worker, given the prompt plus the tokens out so far as its prompt, samples
    the rest of a sequence as one worker would: not when presence or frequency penalties (which
    count the output alone) or a grammar (which follows the output) apply."""
    return params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.guided is None


def splits(params: SamplingParams) -> bool:
    """Whether a one-sequence request can be prefilled on one worker and decoded on another with
    the output of one worker. LoRA requests are not: KV handoff keys blocks by the base model's."""
    return params.max_tokens > 1 and resumes(params) and params.lora is None


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The first token only, under the same rules (a stop token is banned there when min_tokens > 0)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def decode_params(params: SamplingParams, tokens_out: int) -> SamplingParams:
    """The rest, after `tokens_out` tokens (now part of the decode worker's prompt)."""
    return dataclasses.replace(
        params, max_tokens=params.max_tokens - tokens_out, min_tokens=max(params.min_tokens - tokens_out, 0)
    )
