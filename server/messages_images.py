"""Anthropic's image blocks (`{"type": "image", "source": ...}`) read as chat's image urls
(`server.image_parts`): a base64 source becomes a `data:` URL of its media type, a url source is
taken as it is (files only under `--allowed-local-media-path`, never the network)."""

from __future__ import annotations

from typing import Any

from server.errors import bad_request
from server.image_parts import ImageParts

IMAGE_KEYS = frozenset({"type", "source", "cache_control"})
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def image_block_text(block: dict[str, Any], where: str, images: ImageParts | None) -> str:
    """An image block's placeholder text (`ImageParts.add`, its source as a url)."""
    if images is None:
        raise bad_request(f"{where}: image content blocks are not supported here", param="messages")
    images.require_vision(where)
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and set(source) == {"type", "media_type", "data"} and isinstance(source["data"], str):
        if source["media_type"] not in IMAGE_MEDIA_TYPES:
            raise bad_request(f"{where}.source.media_type must be one of {list(IMAGE_MEDIA_TYPES)}", param="messages")
        return images.add(f"data:{source['media_type']};base64,{source['data']}", where)
    if kind == "url" and set(source) == {"type", "url"} and isinstance(source["url"], str):
        return images.add(source["url"], where)
    raise bad_request(
        f'{where}.source must be {{"type": "base64", "media_type": ..., "data": ...}} or {{"type": "url", "url": ...}}',
        param="messages",
    )
