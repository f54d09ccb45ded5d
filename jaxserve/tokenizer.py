"""Text <-> token ids, chat templates and streaming detokenization for a loaded model.

Chat templates are rendered by `jaxserve.chat_template` (imported when a chat is rendered, so
that serving token ids needs no jinja2).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers

from checkpoints.tokenizer_bundle import TokenizerBundle

# Decoders that render each token the same whatever comes before it, except where bytes join
# into a character (byte fallback, byte-level BPE: such tokens alone show U+FFFD) and for a
# leading space stripped at the very start of the text (SentencePiece).
_CONTEXT_FREE_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"})


def _decoder_is_context_free(tokenizer: tokenizers.Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder")
    parts = [] if decoder is None else decoder.get("decoders", []) if decoder["type"] == "Sequence" else [decoder]
    return bool(parts) and all(part["type"] in _CONTEXT_FREE_DECODERS for part in parts)


class TokenTexts:
    """What single tokens decode to, under one tokenizer and `skip_special_tokens` setting:
    computed once per vocabulary entry and shared by all of that tokenizer's detokenizers.

    `alone(t)` is t's text decoded by itself. `after_text(t)` is the text t adds after text
    already shown, where that does not depend on the tokens before it: with a context-free
    decoder, the same after two different probe tokens, not empty, and no U+FFFD in it (a byte
    of a character that the tokens around it complete). Otherwise None: the detokenizer decodes
    its window.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._alone: dict[int, str] = {}
        self._after: dict[int, str | None] = {}
        probes = [tokenizer.encode(text, add_special_tokens=False).ids for text in ("a", "Z")]
        self._probes = [p[0] for p in probes] if _decoder_is_context_free(tokenizer) and all(probes) else []

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def alone(self, token_id: int) -> str:
        text = self._alone.get(token_id)
        if text is None:
            text = self._alone[token_id] = self.decode([token_id])
        return text

    def after_text(self, token_id: int) -> str | None:
        if token_id in self._after:
            return self._after[token_id]
        added = set()
        for probe in self._probes:
            before, after = self.alone(probe), self.decode([probe, token_id])
            added.add(after[len(before) :] if after.startswith(before) else None)
        text = added.pop() if len(added) == 1 else None
        self._after[token_id] = text = text if text and "\ufffd" not in text else None
        return text


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

    In the steady state every token is shown at once and most tokens render the same after any
    text (`TokenTexts.after_text`): such a token's delta is a dictionary lookup, no decode call.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, texts: TokenTexts, context: Sequence[int] = ()) -> None:
        self._texts = texts
        self._ids = [int(i) for i in context[-self.CONTEXT_TOKENS :]] if context else []
        text = texts.decode(self._ids)
        if text.endswith("\ufffd"):
            self._ids, text = [], ""  # a prompt ending inside a character would shift every delta
        self._prefix = 0  # the window starts here: tokens whose text is already out
        self._read = len(self._ids)  # tokens up to here are shown
        self._text_out = bool(text)  # some text is out (a decoder may strip the very first space)

    def _decode(self, ids: list[int]) -> str:
        return self._texts.alone(ids[0]) if len(ids) == 1 else self._texts.decode(ids)

    def _pending(self) -> str:
        """What the window's tokens after `_read` add to its text."""
        shown = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if text.startswith(shown):
            return text[len(shown) :]
        # The decoder re-rendered text already shown: tokenizers' byte fallback turns a whole run
        # of byte tokens into U+FFFD once one byte cannot continue it. Decode the new tokens alone,
        # so only the bad bytes show as U+FFFD (as sentencepiece does).
        return self._decode(self._ids[self._read :])

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one or more new ids; return the newly completed text (possibly empty)."""
        ids = [int(token_ids)] if isinstance(token_ids, (int, np.integer)) else [int(i) for i in token_ids]
        pieces = []
        for token_id in ids:
            all_shown = self._read == len(self._ids)
            self._ids.append(token_id)
            text = self._texts.after_text(token_id) if all_shown and self._text_out else None
            if text is None:
                text = self._pending()
            if text and not text.endswith("\ufffd"):
                pieces.append(text)
                self._prefix, self._read = self._read, len(self._ids)
                self._text_out = True
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
        self._token_texts = {skip: TokenTexts(self._tokenizer, skip) for skip in (True, False)}

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

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A pair of texts as the tokenizer's pair template joins them (BERT's `[CLS] a [SEP] b [SEP]`):
        the ids of the first segment (with its special tokens) and of the second."""
        encoding = self._tokenizer.encode(first, second, add_special_tokens=True)
        split = encoding.type_ids.index(1) if 1 in encoding.type_ids else len(encoding.ids)
        return encoding.ids[:split], encoding.ids[split:]

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
        template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) to the prompt text, with the
        model's chat template or `template` (a server's `--chat-template`).

        Raises `ValueError` when the model has no chat template, and jinja2's `TemplateError`
        when the template rejects the conversation (e.g. roles out of order).
        """
        template = template or self.bundle.chat_template
        if template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        from jaxserve.chat_template import compile_chat_template, normalize_message
        from jaxserve.content_parts import IMAGE_PLACEHOLDER, reads_parts, with_parts

        normalized = [normalize_message(m) for m in messages]
        if reads_parts(template):  # a template that renders a string content as nothing
            normalized = with_parts(normalized, self.bundle.tokenizer.token_to_id(IMAGE_PLACEHOLDER) is not None)
        variables = {**self.bundle.special_tokens, **template_kwargs}
        return compile_chat_template(template).render(
            messages=normalized,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def detokenizer(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A streaming detokenizer; `context` is the prompt (its last tokens give the first
        generated word its leading space where the decoder would strip it)."""
        return IncrementalDetokenizer(self._token_texts[skip_special_tokens], context=context)
