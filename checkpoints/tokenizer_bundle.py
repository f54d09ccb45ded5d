"""Everything a model needs to turn text into ids and back, independent of where it came from.

The bundle is stored on disk in Hugging Face's format (`tokenizer.json` + `tokenizer_config.json`),
so a converted checkpoint's tokenizer can also be read by `transformers`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import tokenizers

from checkpoints.errors import CheckpointError

# The special-token names Hugging Face passes to chat templates (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class TokenizerBundle:
    tokenizer: tokenizers.Tokenizer
    chat_template: str | None
    # name in SPECIAL_TOKEN_NAMES -> token text, only for the tokens the model defines.
    special_tokens: dict[str, str]
    # Every id that ends generation (the tokenizer's eos plus the model's, e.g. Llama 3's <|eot_id|>).
    eos_token_ids: tuple[int, ...]

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.tokenizer.token_to_id(bos)


def merge_eos_ids(*groups: Any) -> tuple[int, ...]:
    """Ordered union of eos ids given as ints, lists of ints or None."""
    ids: list[int] = []
    for group in groups:
        if group is None:
            continue
        for token_id in group if isinstance(group, (list, tuple)) else [group]:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def save_tokenizer_files(bundle: TokenizerBundle, directory: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` as Hugging Face does."""
    directory.mkdir(parents=True, exist_ok=True)
    bundle.tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **bundle.special_tokens}
    if bundle.chat_template is not None:
        tokenizer_config["chat_template"] = bundle.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # Newer transformers writes the template to its own file; older ones keep it in the config,
    # either as a string or as a list of named templates.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default", next(iter(named.values()), None))
    return template


def load_tokenizer_files(directory: Path, extra_eos_ids: Any = None) -> TokenizerBundle:
    """Read a Hugging Face tokenizer (`tokenizer.json`, optional `tokenizer_config.json`)."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise CheckpointError(f"{tokenizer_file}: cannot parse tokenizer: {e}") from e
    config_file = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    special_tokens = {
        name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(tokenizer_config.get(name))) is not None
    }
    eos_id = tokenizer.token_to_id(special_tokens["eos_token"]) if "eos_token" in special_tokens else None
    return TokenizerBundle(
        tokenizer=tokenizer,
        chat_template=_chat_template(directory, tokenizer_config),
        special_tokens=special_tokens,
        eos_token_ids=merge_eos_ids(eos_id, extra_eos_ids),
    )
