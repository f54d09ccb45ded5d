"""Idefics3 / SmolVLM's image preprocessing: an image resized and split into tiles (no JAX here).

As transformers' `SmolVLMImageProcessor` / `Idefics3ImageProcessor` (PIL backend) does it: the
image, converted to RGB, is resized with Lanczos so that its longest edge is `longest_edge` (up or
down; the other edge keeps the aspect ratio, rounded down, then up to even); with splitting, it
is resized again so that both edges are multiples of the tile side (`image_size`), cut into
tiles row by row, and the whole of it resized to one square tile besides (the global image,
last); an image that is one tile already, or any image without splitting, is that one square
tile. Every resize is Pillow's on 8-bit pixels; then 1/255 and mean and std 0.5, as Gemma 3's.
"""

from __future__ import annotations

import dataclasses
import math

from PIL import Image

from jaxserve.images import ImageInput, decode, normalized, rgb

TILED_FAMILY = "idefics3"  # the vision family whose images are tiles (`idefics3_vision.FAMILY`)
_LANCZOS = Image.Resampling.LANCZOS
_MAX_EDGE = 4096  # the processor's bound on any edge after the first resize


@dataclasses.dataclass(frozen=True, eq=False)
class TiledImage:
    """An image as tiles [3, size, size] each: `rows` x `cols` row by row, then the global image
    (rows = cols = 0: the global image alone)."""

    tiles: tuple[ImageInput, ...]
    rows: int
    cols: int


def longest_edge_size(width: int, height: int, longest_edge: int) -> tuple[int, int]:
    """(width, height) with the longest edge `longest_edge`, the other rounded down, then up to
    even; then both scaled below the processor's 4096-pixel bound."""
    if width >= height:
        width, height = longest_edge, int(longest_edge / (width / height))
        height += height % 2
    else:
        width, height = int(longest_edge * (width / height)), longest_edge
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    if max(width, height) > _MAX_EDGE:
        aspect = width / height
        width, height = (
            (_MAX_EDGE, int(_MAX_EDGE / aspect)) if width >= height else (int(_MAX_EDGE * aspect), _MAX_EDGE)
        )
    return max(width, 1), max(height, 1)


def tile_multiple_size(width: int, height: int, tile: int) -> tuple[int, int]:
    """(width, height) rounded up to multiples of `tile`, the shorter edge from the aspect ratio first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return width, height


def split(image: Image.Image, tile: int, longest_edge: int, splitting: bool) -> tuple[list[Image.Image], int, int]:
    """The tiles of an RGB image (see the module docstring), its rows and columns of tiles."""
    image = image.resize(longest_edge_size(*image.size, longest_edge), resample=_LANCZOS)
    if not splitting:
        return [image.resize((tile, tile), resample=_LANCZOS)], 0, 0
    image = image.resize(tile_multiple_size(*image.size, tile), resample=_LANCZOS)
    width, height = image.size
    if width <= tile and height <= tile:
        return [image], 0, 0
    rows, cols = height // tile, width // tile
    tiles = [image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    return [*tiles, image.resize((tile, tile), resample=_LANCZOS)], rows, cols


def preprocess_tiled(image: Image.Image, tile: int, longest_edge: int, splitting: bool) -> TiledImage:
    """A decoded image's tiles, normalised (see the module docstring)."""
    tiles, rows, cols = split(rgb(image), tile, longest_edge, splitting)
    return TiledImage(tuple(ImageInput.of(normalized(t)) for t in tiles), rows, cols)


def load_tiled(data: bytes, tile: int, longest_edge: int, splitting: bool, max_pixels: int) -> TiledImage:
    """Encoded image bytes -> its tiles (ImageError when they cannot be used)."""
    return preprocess_tiled(decode(data, max_pixels), tile, longest_edge, splitting)
