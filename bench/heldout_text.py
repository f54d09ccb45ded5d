"""Real English text for accuracy measures, from a source every Python installation carries.

The text is CPython's own reference documentation as shipped in the standard library
(`pydoc_data.topics`, the help topics `help("if")` prints; Python Software Foundation
documentation, distributed with the interpreter under the PSF license). It is written by people,
is not a tokenizer-generated sample, and needs no download (no network on CI). It differs a little
between Python versions, so compare figures measured on one interpreter version only; the
result JSON records it.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any


def python_docs_text() -> str:
    """The help topics of this interpreter's documentation, in the order of their names."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def first_tokens(tokenizer: Any, text: str, n: int) -> list[int]:
    """The first `n` token ids of `text`, encoding only as much of it as that takes (a prefix
    long enough that cutting it does not change those ids; the whole text at most)."""
    chars = 8 * n + 256
    while True:
        ids = tokenizer.encode(text[:chars])
        if chars >= len(text) or len(ids) >= n + 16:  # 16: a margin for the token cut at the end
            return ids[:n]
        chars *= 2


def load_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): the file at `path`, or the Python documentation's topics."""
    if path:
        return Path(path).read_text(encoding="utf-8"), path
    return python_docs_text(), f"pydoc_data.topics of Python {platform.python_version()}"
