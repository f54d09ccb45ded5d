"""Read-only facts about the served model that request parsing needs on the asyncio thread.

Taken from the engine once at start-up: the tokenizer (thread-safe for encode/decode and chat
templates) and the limits. The engine itself is only touched from its own thread.
"""

from __future__ import annotations

import dataclasses
import time

from jaxserve.dp_router import DataParallelRouter
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    created: int

    @classmethod
    def from_engine(cls, engine: DataParallelRouter, name: str) -> ModelInfo:
        config = engine.config
        return cls(
            name=name,
            tokenizer=engine.tokenizer,
            vocab_size=engine.model_config.vocab_size,
            max_model_len=config.max_model_len,
            max_num_seqs=engine.max_num_seqs,
            block_size=config.block_size,
            created=int(time.time()),
        )

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs show it (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
