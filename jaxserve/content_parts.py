"""Message content as a list of parts, for chat templates that read nothing else.

The server renders a message's content as one string (an image part as the model's placeholder
text). Most templates take that; some read content only as OpenAI-style parts (SmolVLM's and
Idefics3's: `message['content'][0]['type']`, `{% for line in message['content'] %}`), and would
render a string as nothing. For those (`reads_parts`: the template loops over a message's content
and never asks whether content `is string`), a string is passed as its parts: text, and an image part
where the placeholder `<image>` stands (only when the tokenizer has it as a token).
"""

from __future__ import annotations

import re
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
_ITERATES_CONTENT = re.compile(r"""\bfor\s+\w+\s+in\s+message\s*(\[\s*['"]content['"]\s*\]|\.content)""")
_STRING_TEST = re.compile(r"\bis\s+(not\s+)?string\b")


def reads_parts(template: str) -> bool:
    """Whether a chat template reads message content only as a list of typed parts."""
    return bool(_ITERATES_CONTENT.search(template)) and not _STRING_TEST.search(template)


def as_parts(content: str, images: bool) -> list[dict[str, Any]]:
    """A string content's parts: its text, split at each `<image>` into an image part when `images`."""
    pieces = content.split(IMAGE_PLACEHOLDER) if images else [content]
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def with_parts(messages: list[dict[str, Any]], images: bool) -> list[dict[str, Any]]:
    """Messages whose string contents are given as parts (`as_parts`)."""
    return [
        {**m, "content": as_parts(m["content"], images)} if isinstance(m.get("content"), str) else m for m in messages
    ]
