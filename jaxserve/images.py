"""Images of a prompt: decoded and preprocessed on the host with Pillow (no JAX here).

Preprocessing is Gemma 3's image processor's (transformers' `Gemma3ImageProcessor`, PIL backend,
without pan-and-scan): converted to RGB (transparency over white), resized to the vision tower's
square `image_size` with PIL's bilinear filter, scaled by 1/255, normalised with mean and std 0.5,
channels first. An image's `digest` is a hash of those pixels: the encoder cache's key and the
salt of the prompt's image rows in the prefix cache's keys (the same picture sent as PNG or as a
lossless re-encoding is one image; another picture is another).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import warnings

import numpy as np
from PIL import Image

DIGEST_BYTES = 16
_MEAN = _STD = 0.5


class ImageError(ValueError):
    """An image that cannot be used: not an image, truncated, or over a limit (the message says)."""


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image: pixels [3, size, size] f32 and their digest."""

    pixels: np.ndarray
    digest: bytes

    @classmethod
    def of(cls, pixels: np.ndarray) -> ImageInput:
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        return cls(pixels, hashlib.blake2b(pixels.tobytes(), digest_size=DIGEST_BYTES).digest())


def decode(data: bytes, max_pixels: int) -> Image.Image:
    """A Pillow image of encoded bytes (PNG, JPEG, WebP, GIF, ...), fully read; ImageError for bytes
    that are not a whole image, or one of more than `max_pixels` pixels (checked before decoding)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError(f"the image has {width}x{height} pixels; at most {max_pixels} are allowed")
            image.load()
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"the data is not a readable image: {e}") from e
    return image


def rgb(image: Image.Image) -> Image.Image:
    """The image in RGB, transparency over white."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def preprocess(image: Image.Image, size: int) -> ImageInput:
    """Gemma 3's preprocessing of a decoded image into pixels [3, size, size] (see the module docstring)."""
    return ImageInput.of(normalized(rgb(image).resize((size, size), resample=Image.Resampling.BILINEAR)))


def normalized(image: Image.Image) -> np.ndarray:
    """An RGB image's pixels [3, H, W] f32: scaled by 1/255, normalised with mean and std 0.5."""
    scaled = (np.asarray(image, np.float64) * (1 / 255)).astype(np.float32)
    return ((scaled - np.float32(_MEAN)) / np.float32(_STD)).transpose(2, 0, 1)


def load_image(data: bytes, size: int, max_pixels: int) -> ImageInput:
    """Encoded image bytes -> a preprocessed `ImageInput` (ImageError when they cannot be used)."""
    return preprocess(decode(data, max_pixels), size)
