"""Images of a chat for either vision family: read into the tower's inputs and placed in the
prompt (Gemma 3: one square image each, `images` / `image_prompt`; Idefics3 / SmolVLM: tiles,
`tiled_images` / `tiled_prompt`). The server and tests call these; no JAX here (nor `checkpoints`,
which imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxserve.image_prompt import MultimodalPrompt, TextTokenizer, expand_images
from jaxserve.images import ImageInput, load_image
from jaxserve.tiled_images import TILED_FAMILY, TiledImage, load_tiled
from jaxserve.tiled_prompt import expand_tiled

Picture = ImageInput | TiledImage  # one image of a request, as its model's tower takes it


def is_tiled(vision: Any) -> bool:
    return vision.family == TILED_FAMILY


def load_picture(data: bytes, vision: Any, max_pixels: int) -> Picture:
    """Encoded image bytes -> the tower's input (ImageError when they cannot be used)."""
    if is_tiled(vision):
        return load_tiled(data, vision.image_size, vision.longest_edge, vision.do_image_splitting, max_pixels)
    return load_image(data, vision.image_size, max_pixels)


def expand_pictures(text: str, pictures: Sequence[Picture], tokenizer: TextTokenizer, vision: Any) -> MultimodalPrompt:
    """The prompt of rendered chat `text` whose image placeholders stand for `pictures`, in order
    (ValueError when they do not fit)."""
    if is_tiled(vision):
        return expand_tiled(text, pictures, tokenizer, vision)
    return expand_images(text, pictures, tokenizer, vision)
