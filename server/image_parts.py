"""Image content parts of chat messages: collected while the messages are parsed, then read,
decoded and preprocessed off the event loop, and placed in the prompt (`jaxserve.image_prompt`).

Accepted: chat completions' `{"type": "image_url", "image_url": {"url": ...}}` (or the url as a
string), Responses' `{"type": "input_image", "image_url": ...}` (`server.response_items`) and
Anthropic's image blocks as a url (`server.messages_request`). A url is a `data:` URL with
base64 data, or, only under `--allowed-local-media-path`, a `file://` URL of a file inside that
directory. Nothing is fetched from the network: an http(s) URL is a 400. Each limit (images per
request, bytes and pixels per image) is a 400 that says which; the images of a stored context (a
chain of responses, a conversation) count with the input's (`prepend`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from jaxserve.image_prompt import PromptImage
from jaxserve.images import ImageError
from jaxserve.vision_inputs import Picture, expand_pictures, load_picture
from server.config import ServerConfig
from server.errors import bad_request
from server.model_info import ModelInfo

IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """`ServerConfig`'s image settings."""

    max_images: int = 8  # per request
    max_bytes: int = 10 << 20  # of one image, encoded
    max_pixels: int = 4096 * 4096  # of one image, decoded
    allowed_local_media_path: Path | None = None  # file:// URLs are read only inside it

    @classmethod
    def of(cls, config: ServerConfig) -> ImageLimits:
        return cls(
            config.max_images_per_request,
            config.max_image_bytes,
            config.max_image_pixels,
            config.allowed_local_media_path,
        )


@dataclasses.dataclass
class ImageParts:
    """One request's images: their urls in message order as parsing finds them (`take`), then the
    images read (`load`), then their rows in the prompt (`encode`)."""

    info: ModelInfo
    limits: ImageLimits
    param: str = "messages"
    urls: list[str] = dataclasses.field(default_factory=list)
    images: list[Picture] = dataclasses.field(default_factory=list)
    rows: tuple[PromptImage, ...] = ()  # where `encode` placed them

    def __bool__(self) -> bool:
        return bool(self.urls)

    def take(self, part: dict[str, Any], where: str) -> str:
        """The placeholder text of one chat or Responses image part (`add`; 400 for a malformed part)."""
        self.require_vision(where)
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise bad_request(f'{where}: an image part needs "image_url" (a url string, or {{"url": ...}})', self.param)
        return self.add(url, where)

    def require_vision(self, where: str) -> None:
        """400 when the model takes no images."""
        if self.info.vision is None:
            raise bad_request(f"{where}: this model takes no images (it has no vision tower)", param=self.param)

    def add(self, url: str, where: str) -> str:
        """Collect the image at `url` (read by `load`); the placeholder text that stands for it in
        its message (400 for a model without images, or one image too many)."""
        self.require_vision(where)
        if len(self.urls) >= self.limits.max_images:
            raise bad_request(f"at most {self.limits.max_images} images per request", param=self.param)
        self.urls.append(url)
        return self.placeholder()

    def placeholder(self) -> str:
        """The text that stands for an image in a message (the model's image placeholder)."""
        return self.info.tokenizer.decode([self.info.vision.placeholder_token_id], skip_special_tokens=False)

    def collector(self, param: str) -> ImageParts:
        """Parts that collect the images of a stored context (each stored within the limits), for
        `prepend` to count them with this request's."""
        return ImageParts(self.info, dataclasses.replace(self.limits, max_images=sys.maxsize), param)

    def prepend(self, urls: list[str], param: str) -> None:
        """Put the images of the context the request continues (`urls`, in its order) before its
        input's: a 400 (naming `param`) when together they are more than a request may hold."""
        if not urls:
            return
        self.require_vision(param)
        if len(urls) + len(self.urls) > self.limits.max_images:
            raise bad_request(
                f"{param} holds {len(urls)} images and the input {len(self.urls)}: at most "
                f"{self.limits.max_images} images per request, the context's included",
                param=param,
            )
        self.urls = [*urls, *self.urls]

    async def load(self) -> None:
        """Read, decode and preprocess the images, in a worker thread (400 for one that cannot be used)."""
        loop = asyncio.get_running_loop()
        self.images = [await loop.run_in_executor(None, self._load, url, i) for i, url in enumerate(self.urls)]

    def encode(self, text: str) -> list[int]:
        """The token ids of rendered chat `text` with the loaded images expanded in it (`rows`)."""
        try:
            prompt = expand_pictures(text, self.images, self.info.tokenizer, self.info.vision)
        except ValueError as e:
            raise bad_request(f"the images do not fit the prompt: {e}", param=self.param) from None
        self.rows = prompt.images
        return prompt.token_ids

    def _load(self, url: str, index: int) -> Picture:
        data = self._read(url, index)
        if len(data) > self.limits.max_bytes:
            raise bad_request(f"image {index} has {len(data)} bytes; at most {self.limits.max_bytes}", self.param)
        try:
            return load_picture(data, self.info.vision, self.limits.max_pixels)
        except ImageError as e:
            raise bad_request(f"image {index}: {e}", param=self.param) from None

    def _read(self, url: str, index: int) -> bytes:
        scheme = urlparse(url).scheme.lower()
        if scheme == "data":
            found = _DATA_URL.fullmatch(url)
            if found is None:
                raise bad_request(f"image {index}: a data URL must be data:image/<type>;base64,<data>", self.param)
            try:
                return base64.b64decode(found.group(1), validate=True)
            except (binascii.Error, ValueError):
                raise bad_request(f"image {index}: its base64 data is invalid or truncated", self.param) from None
        if scheme == "file":
            return self._read_file(urlparse(url).path, index)
        if scheme in ("http", "https"):
            raise bad_request(f"image {index}: remote image URLs are not fetched; send a data: URL", self.param)
        raise bad_request(f"image {index}: unsupported image URL scheme {scheme!r}", self.param)

    def _read_file(self, path: str, index: int) -> bytes:
        root = self.limits.allowed_local_media_path
        if root is None:
            raise bad_request(f"image {index}: file URLs need --allowed-local-media-path", self.param)
        file = Path(unquote(path)).resolve()
        if not file.is_relative_to(root.resolve()) or not file.is_file():
            raise bad_request(f"image {index}: no such file under the allowed local media path", self.param)
        if file.stat().st_size > self.limits.max_bytes:
            raise bad_request(f"image {index} has more than {self.limits.max_bytes} bytes", self.param)
        return file.read_bytes()
