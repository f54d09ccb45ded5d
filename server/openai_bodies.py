"""OpenAI response bodies and stream chunks of completions and chat completions (`text_completion`,
`chat.completion`, `chat.completion.chunk`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxserve.outputs import Delta, TokenLogprob
from server.model_info import ModelInfo
from server.reply_stream import ReplyParsing, ReplyStream
from server.tool_formats import new_call_id
from server.tool_stream import CallStart, Content, Event, Reasoning


@dataclasses.dataclass
class UsageCount:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens (with a reasoning parser)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }


@dataclasses.dataclass
class ChoiceOutput:
    """What one choice has produced so far (non-streaming responses collect into this)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(info: ModelInfo, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for lp in logprobs:
        token = info.token_text(lp.token_id)
        top = []
        for token_id, value in lp.top:
            top_text = info.token_text(token_id)
            top.append({"token": top_text, "logprob": value, "bytes": _token_bytes(top_text)})
        content.append({"token": token, "logprob": lp.logprob, "bytes": _token_bytes(token), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    info: ModelInfo,
    logprobs: list[TokenLogprob],
    offset: int,
    prompt: list[TokenLogprob | None] | None = None,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The legacy completions shape; `offset` is the text length before these tokens. With
    `echo`, the prompt's scores (`prompt`, None for its first token `prompt_ids[0]`) come first."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    entries = [] if prompt is None else [(prompt_ids[0], None)] + [(lp.token_id, lp) for lp in prompt[1:]]
    entries += [(lp.token_id, lp) for lp in logprobs]
    for token_id, lp in entries:
        token = info.token_text(token_id)
        tokens.append(token)
        token_logprobs.append(None if lp is None else lp.logprob)
        top: dict[str, float] | None = None
        if lp is not None:
            top = {}
            for top_id, value in lp.top:  # best first; ids that share a text keep the best value
                top.setdefault(info.token_text(top_id), value)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def prompt_logprobs_field(info: ModelInfo, scores: list[TokenLogprob | None] | None) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, then a map from token id
    (as a string) to its logprob, rank and text, for the prompt's token and the most likely ones."""
    if scores is None:
        return None
    out: list[Any] = [None]
    for lp in scores[1:]:
        entry = {
            str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": info.token_text(lp.token_id)}
        }
        for rank, (token_id, value) in enumerate(lp.top, 1):
            entry.setdefault(
                str(token_id), {"logprob": value, "rank": rank, "decoded_token": info.token_text(token_id)}
            )
        out.append(entry)
    return out


class CompletionShapes:
    """`text_completion` objects (one response, or the chunks of a stream).

    With `echo` (the prompts' texts and token ids, each prompt giving `n` choices) every
    choice's text starts with its prompt: in the response, or in the first chunk of a stream;
    with logprobs, so do its log-probabilities (the first prompt token's are null).
    """

    def __init__(
        self,
        response_id: str,
        info: ModelInfo,
        echo: list[tuple[str, list[int]]] | None = None,
        n: int = 1,
        show_prompt_logprobs: bool = False,
    ) -> None:
        self.id = response_id
        self.show_prompt_logprobs = show_prompt_logprobs
        self.info = info
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}
        self._echo = echo
        self._n = n
        self._echoed: set[int] = set()

    def _prompt_text(self, index: int) -> str:
        return "" if self._echo is None else self._echo[index // self._n][0]

    def _logprobs(
        self, index: int, logprobs: list[TokenLogprob], offset: int, prompt: list[TokenLogprob | None] | None
    ) -> dict[str, Any]:
        """A choice's completions logprobs; with echo, `prompt` scores come first."""
        if self._echo is None or prompt is None:
            return completion_logprobs(self.info, logprobs, offset)
        return completion_logprobs(self.info, logprobs, offset, prompt, self._echo[index // self._n][1])

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.info.name,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(self, index: int, delta: Delta, include_usage: bool) -> dict[str, Any]:
        text, prompt = delta.text, None
        if index not in self._echoed:
            self._echoed.add(index)
            text = self._prompt_text(index) + text
            prompt = delta.prompt_logprobs
        logprobs = None
        if delta.logprobs is not None:
            offset = self._offsets.get(index, 0)
            logprobs = self._logprobs(index, delta.logprobs, offset, prompt)
            self._offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        if self.show_prompt_logprobs and delta.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(self.info, delta.prompt_logprobs)
        body = self._envelope([choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: UsageCount) -> dict[str, Any]:
        return {**self._envelope([]), "usage": usage.as_dict()}

    def response(self, choices: list[ChoiceOutput], usage: UsageCount) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            logprobs = self._logprobs(i, c.logprobs, 0, c.prompt_logprobs) if c.logprobs is not None else None
            choice = {
                "index": i,
                "text": self._prompt_text(i) + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
            if self.show_prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_field(self.info, c.prompt_logprobs)
            out.append(choice)
        return {**self._envelope(out), "usage": usage.as_dict()}


class ChatShapes:
    """`chat.completion` and `chat.completion.chunk` objects. With a `ReplyParsing` (tools or a
    reasoning parser), a reply's reasoning becomes `reasoning_content` and its tool calls
    `tool_calls` (finish reasons as OpenAI gives them: `ToolCalling.reply`); a stream sends them as
    they are written (`server.reply_stream`): reasoning deltas, content up to where a call starts,
    and each call's id and name, then its argument fragments, one chunk each."""

    def __init__(
        self,
        response_id: str,
        info: ModelInfo,
        parsing: ReplyParsing | None = None,
        show_prompt_logprobs: bool = False,
    ) -> None:
        self.id = response_id
        self.info = info
        self.created = int(time.time())
        self._parsing = parsing
        self._streams: dict[int, ReplyStream] = {}  # per choice
        self._texts: dict[int, str] = {}  # per choice: its reply so far
        self.show_prompt_logprobs = show_prompt_logprobs  # vLLM's top-level `prompt_logprobs`

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.info.name,
            "system_fingerprint": None,
            "choices": choices,
        }

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        """The first chunk of each choice: the role, no content yet."""
        body = self._envelope(
            "chat.completion.chunk",
            [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        )
        if include_usage:
            body["usage"] = None
        return body

    def chunks(self, index: int, delta: Delta, include_usage: bool) -> list[dict[str, Any]]:
        """The chunks of a delta: none when it shows nothing yet (a call's name still being
        written), else one per piece, the finish reason on the last, the logprobs on the first."""
        logprobs = chat_logprobs(self.info, delta.logprobs) if delta.logprobs is not None else None
        finish_reason = delta.finish_reason
        if self._parsing is None:
            pieces = [{"content": delta.text}] if delta.text or finish_reason is None else []
        else:
            pieces, finish_reason = self._parsed(index, delta)
        if not pieces and logprobs is None and finish_reason is None:
            return []
        out = []
        for piece in pieces or [{}]:
            choice = {"index": index, "delta": piece, "logprobs": None, "finish_reason": None}
            out.append(self._envelope("chat.completion.chunk", [choice]))
            if include_usage:
                out[-1]["usage"] = None
        out[0]["choices"][0]["logprobs"] = logprobs
        out[-1]["choices"][0]["finish_reason"] = finish_reason
        if self.show_prompt_logprobs and delta.prompt_logprobs is not None:
            out[0]["prompt_logprobs"] = prompt_logprobs_field(self.info, delta.prompt_logprobs)
        return out

    def _parsed(self, index: int, delta: Delta) -> tuple[list[dict[str, Any]], str | None]:
        """A delta's pieces as the reply's parsing shows them, and the choice's finish reason."""
        stream = self._streams.setdefault(index, self._parsing.stream())
        text = self._texts[index] = self._texts.get(index, "") + delta.text
        if delta.finish_reason is None:
            events, finish_reason = stream.update(text), None
        else:
            events, parts = stream.finish(text, delta.finish_reason)
            finish_reason = parts.finish_reason
        return [self._piece(event) for event in events], finish_reason

    def _piece(self, event: Event) -> dict[str, Any]:
        if isinstance(event, Reasoning):
            return {"reasoning_content": event.text}
        if isinstance(event, Content):
            return {"content": event.text}
        if isinstance(event, CallStart):
            call = {"index": event.index, "id": new_call_id(), "type": "function"}
            return {"tool_calls": [{**call, "function": {"name": event.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def count_reasoning(self, choices: list[ChoiceOutput], usage: UsageCount) -> None:
        """Set the usage's reasoning tokens from the choices' finished replies."""
        if self._parsing is not None and self._parsing.reads_reasoning:
            usage.reasoning_tokens = sum(
                self._parsing.reasoning_tokens(self.info.tokenizer, c.token_ids) for c in choices
            )

    def usage_chunk(self, usage: UsageCount) -> dict[str, Any]:
        return {**self._envelope("chat.completion.chunk", []), "usage": usage.as_dict()}

    def response(self, choices: list[ChoiceOutput], usage: UsageCount) -> dict[str, Any]:
        self.count_reasoning(choices, usage)
        out = []
        for i, c in enumerate(choices):
            logprobs = chat_logprobs(self.info, c.logprobs) if c.logprobs is not None else None
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
            finish_reason = c.finish_reason
            if self._parsing is not None:
                parts = self._parsing.parts(c.text, finish_reason)
                message["content"], finish_reason = parts.content, parts.finish_reason
                if self._parsing.reads_reasoning:
                    message["reasoning_content"] = parts.reasoning
                if parts.calls:
                    message["tool_calls"] = [call.as_dict() for call in parts.calls]
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        body = {**self._envelope("chat.completion", out), "usage": usage.as_dict()}
        if self.show_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_field(self.info, choices[0].prompt_logprobs if choices else None)
        return body
