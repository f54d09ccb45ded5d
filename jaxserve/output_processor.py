"""Per-sequence output handling: detokenize incrementally, find stop strings, cut deltas.

The engine writes each sampled token into the request and applies the stop rules
(`LLMEngine._update`); a stream only reads the token: it keeps the ids and log-probabilities
of the next delta, the text, and says whether a stop string has appeared. Stop strings never
leak: text that could still turn out to be the start of a stop string is held back until the
next token decides it (or the sequence ends).
"""

from __future__ import annotations

from jaxserve.outputs import Delta, TokenLogprob, Usage
from jaxserve.request import FinishReason, Request
from jaxserve.runner import SampledToken
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


class SequenceStream:
    def __init__(self, group_id: str, request: Request, index: int, tokenizer: Tokenizer):
        self.group_id = group_id  # the id the caller used; `request` may be one of n choices
        self.request = request
        self.index = index
        params = request.params
        self.detokenizer = tokenizer.detokenizer(params.skip_special_tokens, context=request.prompt_token_ids)
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
        k = self.request.params.logprobs
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
        self.text = self.text[: start + (length if self.request.params.include_stop_str_in_output else 0)]
        self.cut_at_stop_string = True
        return True

    def take_delta(self, finish_reason: FinishReason | None, usage: Usage | None,
                   error: BaseException | None = None) -> Delta | None:
        """The output since the last delta, or None when there is nothing to report yet."""
        if finish_reason is not None:
            if not self.cut_at_stop_string:
                self.text += self.detokenizer.finish()
            end = len(self.text)
        else:
            end = len(self.text) - _stop_holdback(self.text, self.stops)
        text = self.text[self.emitted:end]
        if not text and not self.new_token_ids and finish_reason is None:
            return None
        self.emitted = max(self.emitted, end)
        delta = Delta(
            request_id=self.group_id,
            index=self.index,
            text=text,
            token_ids=self.new_token_ids,
            logprobs=self.new_logprobs if self.request.params.logprobs is not None else None,
            finish_reason=finish_reason.value if finish_reason is not None else None,
            usage=usage,
            error=None if error is None else f"{type(error).__name__}: {error}",
            prompt_logprobs=self._take_prompt_logprobs(),
        )
        self.new_token_ids, self.new_logprobs = [], []
        return delta

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        scores = self.request.prompt_logprobs
        if self.sent_prompt_logprobs or scores is None or len(scores) < self.request.num_prompt_tokens:
            return None
        self.sent_prompt_logprobs = True
        return scores
