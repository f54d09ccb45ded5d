"""Structured output: grammars that constrain what a request may generate (llguidance).

`GuidedDecoding` (in `SamplingParams.guided`) says what the output must match; the engine keeps
one `GrammarState` per sequence, asks it for the packed mask of allowed tokens before each step
that samples for it, and advances it with each sampled token (`LLMEngine._update`).
"""

from jaxserve.structured.grammar import GrammarCompiler, GrammarState, mask_words
from jaxserve.structured.spec import GUIDED_KINDS, GuidedDecoding
from jaxserve.structured.strict import strict_schema

__all__ = ["GUIDED_KINDS", "GrammarCompiler", "GrammarState", "GuidedDecoding", "mask_words", "strict_schema"]
