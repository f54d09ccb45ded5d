"""One sequence's text: detokenize incrementally, find stop strings, cut deltas.

The engine writes each sampled token into its request and applies the stop rules
(`jaxserve.engine.LLMEngine`); a stream only reads the token: it keeps the ids and
log-probabilities of the next delta, the text, and says whether a stop string has appeared. Stop
strings never leak: text that could still turn out to be the start of a stop string is held back
until the next token decides it (or the sequence ends). A router over workers applies stop
strings itself with the same class, so its deltas equal one process's.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.outputs import Delta, FinishReason, SampledToken, TokenLogprob, Usage
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class TextStream:
    def __init__(
        self, group_id: str, index: int, params: SamplingParams, prompt_ids: Sequence[int], tokenizer: Tokenizer
    ):
        self.group_id = group_id  # the id the caller used; the sequence is its choice `index`
        self.index = index
        self.params = params
        self.num_prompt_tokens = len(prompt_ids)
        self.detokenizer = tokenizer.detokenizer(params.skip_special_tokens, context=prompt_ids)
        self.stops = list(params.stop)
        self.text = ""
        self.cut_at_stop_string = False
        self.emitted = 0  # characters of `text` already delivered
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[TokenLogprob] = []
        self.sent_prompt_logprobs = False

    def add_token(self, sampled: SampledToken) -> None:
        """Keep a sampled token (and its log-probabilities, if asked) for the next delta."""
        self.new_token_ids.append(sampled.token_id)
        k = self.params.logprobs
        if k is not None:
            top = [(int(i), float(p)) for i, p in zip(sampled.top_ids[:k], sampled.top_logprobs[:k])]
            self.new_logprobs.append(TokenLogprob(sampled.token_id, sampled.logprob, top))

    def add_text(self, token_id: int, check_stops: bool) -> bool:
        """Detokenize a token; True when a stop string has appeared (the text is cut there)."""
        before = len(self.text)
        self.text += self.detokenizer.add(token_id)
        if not (check_stops and self.stops):
            return False
        window = max(0, before - max(len(s) for s in self.stops) + 1)
        hits = [(i, len(s)) for s in self.stops if (i := self.text.find(s, window)) >= 0]
        if not hits:
            return False
        start, length = min(hits)  # the earliest stop; of two there, the shorter
        self.text = self.text[: start + (length if self.params.include_stop_str_in_output else 0)]
        self.cut_at_stop_string = True
        return True

    def take_delta(
        self,
        finish_reason: FinishReason | None,
        usage: Usage | None,
        error: BaseException | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> Delta | None:
        """The output since the last delta, or None when there is nothing to report yet.
        `prompt_logprobs`: the prompt's scores so far; sent once, with the first delta after all
        of them are in."""
        if finish_reason is not None:
            if not self.cut_at_stop_string:
                self.text += self.detokenizer.finish()
            end = len(self.text)
        else:
            end = len(self.text) - _stop_holdback(self.text, self.stops)
        text = self.text[self.emitted : end]
        if not text and not self.new_token_ids and finish_reason is None:
            return None
        self.emitted = max(self.emitted, end)
        delta = Delta(
            request_id=self.group_id,
            index=self.index,
            text=text,
            token_ids=self.new_token_ids,
            logprobs=self.new_logprobs if self.params.logprobs is not None else None,
            finish_reason=finish_reason.value if finish_reason is not None else None,
            usage=usage,
            error=None if error is None else f"{type(error).__name__}: {error}",
            prompt_logprobs=self._take_prompt_logprobs(prompt_logprobs),
        )
        self.new_token_ids, self.new_logprobs = [], []
        return delta

    def _take_prompt_logprobs(self, scores: list[TokenLogprob | None] | None) -> list[TokenLogprob | None] | None:
        if self.sent_prompt_logprobs or scores is None or len(scores) < self.num_prompt_tokens:
            return None
        self.sent_prompt_logprobs = True
        return scores
