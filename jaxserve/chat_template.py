"""Chat templates rendered the way Hugging Face `transformers` renders them
(`apply_chat_template(..., tokenize=False)`): a sandboxed jinja2 environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block tag,
`raise_exception`, `strftime_now`, a `tojson` filter that does not escape HTML and keeps
non-ASCII characters, the special tokens (`bos_token`, `eos_token`, ...) as variables, and
messages whose `None`-valued keys are dropped and whose reasoning text appears both as
`reasoning_content` and `thinking`. Used by `jaxserve.tokenizer.Tokenizer.apply_chat_template`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text in some templates; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Names a message's reasoning may come under; templates read `reasoning_content` (or `thinking`).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """As transformers does: drop keys whose value is None, and expose reasoning under both names."""
    normalized = {k: v for k, v in dict(message).items() if v is not None}
    reasoning = next((normalized[k] for k in _REASONING_KEYS if k in normalized), None)
    if reasoning is not None:
        normalized = {"thinking": reasoning, **normalized, "reasoning_content": reasoning}
    return normalized


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
