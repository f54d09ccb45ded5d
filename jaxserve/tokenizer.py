"""Text <-> token ids, chat templates and streaming detokenization for a loaded model.

Chat templates are rendered by `jaxserve.chat_template` (imported when a chat is rendered, so
that serving token ids needs no jinja2).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import tokenizers

from checkpoints.tokenizer_bundle import TokenizerBundle


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for streaming.

    Each new token decodes a short window (tokens already shown, then the new ones) and emits
    what the window's text gained, as vLLM does. So:
    - any id sequence works: decoding never fails (bytes that form no character show as U+FFFD);
    - a delta never ends inside a multi-byte character: text ending in U+FFFD is held back until
      later tokens complete it, and `finish()` releases what is still held at the end;
    - `context` (the prompt's last tokens) is decoded before the first new tokens, so decoders
      that strip a leading space (SentencePiece) keep the space of the first generated word.
    `"".join(deltas) + finish()` equals what decoding `context + ids` adds to decoding `context`
    (without context: `decode(ids)`).

    In the steady state every token is shown at once, so the window's shown part is one token:
    its text comes from `token_texts` (decoded once per vocabulary entry, shared by the
    tokenizer's detokenizers), and such a token costs one decode call, not two.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool = True,
                 context: Sequence[int] = (), token_texts: dict[int, str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_texts = {} if token_texts is None else token_texts
        self._ids = [int(i) for i in context[-self.CONTEXT_TOKENS:]] if context else []
        if self._decode(self._ids).endswith("\ufffd"):
            self._ids = []  # a prompt ending inside a character would shift every delta
        self._prefix = 0  # the window starts here: tokens whose text is already out
        self._read = len(self._ids)  # tokens up to here are shown

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            text = self._token_texts.get(ids[0])
            if text is None:
                text = self._token_texts[ids[0]] = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
            return text
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _pending(self) -> str:
        """What the window's tokens after `_read` add to its text."""
        shown = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if text.startswith(shown):
            return text[len(shown):]
        # The decoder re-rendered text already shown: tokenizers' byte fallback turns a whole run
        # of byte tokens into U+FFFD once one byte cannot continue it. Decode the new tokens alone,
        # so only the bad bytes show as U+FFFD (as sentencepiece does).
        return self._decode(self._ids[self._read:])

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one or more new ids; return the newly completed text (possibly empty)."""
        ids = [int(token_ids)] if isinstance(token_ids, (int, np.integer)) else [int(i) for i in token_ids]
        pieces = []
        for token_id in ids:
            self._ids.append(token_id)
            text = self._pending()
            if text and not text.endswith("\ufffd"):
                pieces.append(text)
                self._prefix, self._read = self._read, len(self._ids)
        return "".join(pieces)

    def finish(self) -> str:
        """At the end of the stream: the text still held back (an incomplete character), as a
        full decode renders it (U+FFFD)."""
        text = self._pending()
        self._prefix, self._read = self._read, len(self._ids)
        return text


class Tokenizer:
    """The tokenizer of a loaded model (see `checkpoints.registry.load_model(...).tokenizer_bundle`)."""

    def __init__(self, bundle: TokenizerBundle) -> None:
        self.bundle = bundle
        self._tokenizer = bundle.tokenizer
        # Each token's text alone, by skip_special_tokens: see IncrementalDetokenizer.
        self._token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.bundle.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.bundle.bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def chat_template(self) -> str | None:
        return self.bundle.chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`. Special-token text (e.g. `<|im_start|>`) maps to its id, as in Hugging Face.

        `add_special_tokens=True` adds what the tokenizer's post-processor adds (e.g. a BOS).
        """
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) to the prompt text.

        Raises `ValueError` when the model has no chat template, and jinja2's `TemplateError`
        when the template rejects the conversation (e.g. roles out of order).
        """
        if self.bundle.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        from jaxserve.chat_template import compile_chat_template, normalize_message

        normalized = [normalize_message(m) for m in messages]
        variables = {**self.bundle.special_tokens, **template_kwargs}
        return compile_chat_template(self.bundle.chat_template).render(
            messages=normalized,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def detokenizer(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A streaming detokenizer; `context` is the prompt (its last tokens give the first
        generated word its leading space where the decoder would strip it)."""
        return IncrementalDetokenizer(self._tokenizer, skip_special_tokens=skip_special_tokens, context=context,
                                      token_texts=self._token_texts[skip_special_tokens])
