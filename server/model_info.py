"""Read-only facts about the served model that request parsing needs on the asyncio thread.

Taken from the engine's `EngineInfo` once at start-up: the tokenizer (thread-safe for
encode/decode and chat templates) and the limits.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxserve.engine_client import EngineInfo
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    hidden_size: int
    created: int
    chat_template: str | None = None  # the server's --chat-template, used instead of the model's
    encoder: Any = None  # an encoder-only embedding model's EncoderConfig (`EngineInfo.encoder`)
    vision: Any = None  # a vision-language model's vision tower config (`EngineInfo.vision`)

    @property
    def template(self) -> str | None:
        """The chat template that prompts are rendered with."""
        return self.chat_template or self.tokenizer.chat_template

    @classmethod
    def from_engine(cls, info: EngineInfo, name: str, chat_template: str | None = None) -> ModelInfo:
        return cls(
            name=name,
            tokenizer=info.tokenizer,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            max_num_seqs=info.max_num_seqs,
            block_size=info.block_size,
            hidden_size=info.hidden_size,
            created=int(time.time()),
            chat_template=chat_template,
            encoder=info.encoder,
            vision=info.vision,
        )

    def token_text(self, token_id: int) -> str:
        """The text of one token as logprobs show it (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
