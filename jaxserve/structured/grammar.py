"""Grammar state per sequence, on the host: the packed mask of allowed tokens, and its advance.

The mask of a row is `int32[ceil(V / 32)]`, bit `t % 32` of word `t // 32` set when token t is
allowed (llguidance's layout); the sampler applies it on the device (`jaxserve.sampler`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import numpy as np
import tokenizers

from jaxserve.structured.spec import GuidedDecoding


def mask_words(vocab_size: int) -> int:
    """32-bit words of a packed token mask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


class GrammarCompiler:
    """Builds grammar states for one model's tokenizer. The llguidance tokenizer (its token
    trie, ~1-2 s to build for a 49k vocabulary) is built on first use, once."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._eos = list(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self._tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._ll

    def states(self, spec: GuidedDecoding, n: int) -> list[GrammarState]:
        """`n` independent states at the start of `spec` (one per choice). ValueError when the
        grammar does not compile against this tokenizer."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be used: {matcher.get_error()}")
        return [GrammarState(matcher if i == 0 else matcher.deep_copy(), self.vocab_size) for i in range(n)]


class GrammarRejectedError(RuntimeError):
    """A sampled token that the grammar does not allow (the mask was not applied)."""


class GrammarState:
    """One sequence's position in its grammar. `write_mask` is asked before a step samples for
    the sequence, `advance` with the token that step sampled."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._words = mask_words(vocab_size)

    def write_mask(self, out: np.ndarray) -> None:
        """Write the tokens allowed next into `out`, a contiguous int32[ceil(V / 32)] row (of the
        step's sampling tensors: no copy)."""
        if out.dtype != np.int32 or out.shape != (self._words,) or not out.flags.c_contiguous:
            raise ValueError(f"a token mask row must be contiguous int32[{self._words}]")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def advance(self, token_id: int) -> None:
        """Consume a sampled token; GrammarRejectedError if the grammar does not allow it."""
        if not self._matcher.consume_token(int(token_id)):
            raise GrammarRejectedError(f"token {token_id} is not allowed by the grammar: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The output is complete: the grammar accepts it and allows nothing but EOS."""
        return self._matcher.is_stopped()
