"""A generation request's state as the scheduler and engine see it (no JAX here)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import TYPE_CHECKING

from jaxserve.image_prompt import PromptImage, chunk_end, salt_cache_tokens
from jaxserve.outputs import FinishReason, TokenLogprob
from jaxserve.pooling import PromptPooling
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.kv import ChainKeys, KVHandle
    from jaxserve.lora.manager import AdapterRef
    from jaxserve.structured import GrammarState
    from jaxserve.text_stream import TextStream

# An output token sampled by a step still running on the device. The engine appends one when it
# launches a step that samples for the request and overwrites it with the token once the step's
# output is read; a step that consumes it as input takes the token from the previous step's
# output on the device, so the host never waits for it.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: back to the waiting queue with its tokens kept
    SWAPPED = "swapped"  # its blocks live in the host tier until it is swapped back in
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence being generated. `n > 1` requests are expanded into n of these by the engine.

    `num_computed_tokens` counts the tokens whose K/V are in the cache (or are being written by a
    launched step). The tokens to compute next are `copy_tokens(num_computed_tokens)`: the
    rest of the prompt while prefilling, then the one token sampled last step, which may still
    be a PLACEHOLDER while that step runs.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's own seed, or one drawn for it at creation
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    # With params.prompt_logprobs: each prompt position's log-probability, scored so far (None
    # at position 0, which has no context); None for a request that does not score its prompt.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: GrammarState | None = None  # structured output: the sequence's grammar position
    # Its block table while it holds KV (running or swapped out): made and edited by the KV manager.
    kv: KVHandle | None = None
    # Content keys of its full blocks (`jaxserve.kv.content_keys`), computed as far as asked: the
    # prefix cache's disk tier and the scheduler's check for blocks another prefill computes.
    block_keys: ChainKeys | None = None
    batch_row: int | None = None  # its row of the runner's persistent batch while it runs
    # Its output as text: detokenized, stop strings found, cut into deltas (the engine's).
    text: TextStream | None = dataclasses.field(default=None, repr=False)
    pooling: PromptPooling | None = None  # an embedding request: its prompt's pooled rows so far
    adapter: AdapterRef | None = None  # its LoRA adapter (None: the base model)
    lora_slot: int = -1  # the LoRA slot its adapter is pinned in while it runs (-1: none)
    images: tuple[PromptImage, ...] = ()  # its prompt's images (a vision-language model's)

    def copy_tokens(self, start: int = 0, stop: int | None = None) -> list[int]:
        """A new list of the sequence's tokens [start, stop) (0 <= start <= stop <= num_tokens;
        default: to the end), the prompt's then the output's. It copies that range only: a caller
        that needs the length, the last token or a few tokens asks for just those."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        stop = self.num_tokens if stop is None else stop
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return prompt[start:] + self.output_token_ids[: stop - n]

    def copy_cache_tokens(self, stop: int | None = None) -> list[int]:
        """`copy_tokens(0, stop)` as the prefix cache keys them: a LoRA request's first token
        salted by its adapter (`AdapterRef.salt`), so KV computed with different adapters is never
        shared; an image's soft tokens salted by its digest (`salt_cache_tokens`)."""
        ids = self.copy_tokens(0, stop)
        if self.adapter is not None and ids:
            ids[0] = self.adapter.salt(ids[0])
        if self.images:
            salt_cache_tokens(ids, self.images)
        return ids

    def prefill_chunk(self, start: int, n: int) -> int:
        """Tokens a prefill chunk from `start` may take, at most `n`: it never ends inside an
        image attended both ways (`chunk_end`; 0: it must wait for a step with room for the whole image)."""
        return chunk_end(self.images, start, n) if self.images else n

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        return self.params.priority

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end the sequence: the request's stop ids, and EOS unless `ignore_eos`."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return frozenset((*self.params.stop_token_ids, *eos))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def num_known_tokens(self) -> int:
        """Tokens from position 0 up to the first one still in flight (a PLACEHOLDER)."""
        out = self.output_token_ids
        n = len(out)
        while n and out[n - 1] == PLACEHOLDER:
            n -= 1
        return len(self.prompt_token_ids) + n

    @property
    def num_cacheable_tokens(self) -> int:
        """How much of the sequence a prefix-cache hit may cover: all of it, except for a request
        still scoring its prompt, or pooling the mean of its rows, whose unscored (unpooled) rows
        must be computed (their hidden states are what the scores and the pooled vector come from)."""
        first_needed = None if self.pooling is None else self.pooling.first_needed(self.num_prompt_tokens)
        if first_needed is not None:
            return first_needed
        if self.prompt_logprobs is None or len(self.prompt_logprobs) >= self.num_prompt_tokens:
            return self.num_tokens
        return len(self.prompt_logprobs) - 1  # the row that scores the first unscored position

    def add_prompt_logprobs(self, first: int, scored: list[TokenLogprob]) -> None:
        """Record the scores of prompt positions `first`, `first + 1`, ...; positions already
        recorded (scored again by a recompute launched before the first scores were read) are
        kept as they are."""
        have = self.prompt_logprobs
        skip = len(have) - first
        if skip < 0:
            raise ValueError(f"prompt scores from position {first} leave a gap after {len(have)}")
        have.extend(scored[skip:])

    @property
    def awaits_token(self) -> bool:
        """A constrained request whose last sampled token is still in flight: its next mask
        depends on that token, so it cannot be scheduled to sample until the token is read."""
        return self.grammar is not None and bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    def ends_by_length(self, num_output: int, max_model_len: int) -> bool:
        """Whether `num_output` generated tokens end the request by length: `max_tokens` or the
        context. The engine asks it of each token it reads; the scheduler of the tokens so far,
        placeholders counted, since such a request needs no further step."""
        return num_output >= self.params.max_tokens or self.num_prompt_tokens + num_output >= max_model_len

    # ----- its state changes: the scheduler and the engine ask, the request writes -----------

    def start_running(self, kv: KVHandle, num_cached_tokens: int) -> None:
        """Admitted with `kv`, whose first `num_cached_tokens` tokens the prefix cache held."""
        self.kv = kv
        self.num_computed_tokens = num_cached_tokens
        if self.num_preemptions == 0:
            self.num_cached_prompt_tokens = num_cached_tokens
        self.status = RequestStatus.RUNNING

    def preempt(self, swapped: bool) -> None:
        """Taken off the device: its blocks swapped out to the host tier (it resumes where it
        was), or freed (its tokens are computed again, hitting the prefix cache)."""
        self.num_preemptions += 1
        if swapped:
            self.status = RequestStatus.SWAPPED
        else:
            self.kv = None
            self.num_computed_tokens = 0
            self.status = RequestStatus.PREEMPTED

    def swapped_in(self) -> None:
        self.status = RequestStatus.RUNNING

    def launched(self, end: int, samples: bool) -> int | None:
        """A step computing its tokens up to `end` is on the device; one that samples for it
        leaves a PLACEHOLDER for the new token, whose index in the output it returns."""
        self.num_computed_tokens = end
        if not samples:
            return None
        self.output_token_ids.append(PLACEHOLDER)
        return len(self.output_token_ids) - 1

    def land_token(self, index: int, token: int) -> None:
        """Output token `index` was read (over its placeholder, or after a verified decode's
        accepted drafts); the grammar of structured output advances over it."""
        if index == len(self.output_token_ids):
            self.output_token_ids.append(token)
        else:
            self.output_token_ids[index] = token
        if self.grammar is not None:
            self.grammar.advance(token)

    def finish(self, reason: FinishReason) -> None:
        """End the request (its blocks freed); placeholders of steps still in flight are dropped
        (never output)."""
        while self.output_token_ids and self.output_token_ids[-1] == PLACEHOLDER:
            self.output_token_ids.pop()
        self.kv = None  # freed by the scheduler
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
