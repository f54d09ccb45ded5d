"""The images of a session (`/v1/sessions`): each message lists its images' keys, in order, and the
session keeps each distinct url once, keyed by its SHA-256 (as a stored response keeps its chain's,
`server.response_prompt.kept_images`).

A message's content holds the model's image placeholder where each of its images stands (as chat
renders an image part), and its `"images"` holds their keys in the same order. A turn's prompt places
the history's images again, before the new message's, so it is the prompt of the whole conversation
sent as chat (same tokens), and the prefix cache, keyed by the images' hashes, holds its start. A
`file://` image is kept as its url and read again (under `--allowed-local-media-path`) at each turn.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from server.errors import bad_request
from server.image_parts import ImageParts


def url_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def attach(messages: list[dict[str, Any]], images: ImageParts, first: int = 0) -> dict[str, str]:
    """Give each of `messages` (parsed with `images`) the keys of its images, `images.urls[first:]` in
    order, as many as its content holds placeholders; returns the urls by key (400 when the counts differ)."""
    placeholder = images.placeholder() if images else ""
    urls = images.urls[first:]
    taken = 0
    for message in messages:
        count = message["content"].count(placeholder) if placeholder else 0
        if count:
            message["images"] = [url_key(url) for url in urls[taken : taken + count]]
        taken += count
    if taken != len(urls):
        raise bad_request(f"the messages hold {taken} image placeholders for {len(urls)} images", param=images.param)
    return {url_key(url): url for url in urls}


def history_urls(messages: Sequence[dict[str, Any]], kept: dict[str, str]) -> list[str]:
    """The urls of the images of `messages`, in prompt order."""
    return [kept[key] for m in messages for key in m.get("images", ())]


def kept_urls(messages: Sequence[dict[str, Any]], kept: dict[str, str]) -> dict[str, str]:
    """The urls `messages` refer to, each once (what a session keeps with that history)."""
    return {key: kept[key] for m in messages for key in m.get("images", ())}


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    return any(m.get("images") for m in messages)
