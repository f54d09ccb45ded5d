"""The test images of the vision-language tests: small PNGs drawn from a seed (nothing committed but this).

Each is a smooth colour gradient with a few random rectangles, of a size that is not the vision
tower's (so the resize matters) and, for one, not square.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

SIZES = {"red": (40, 48), "blue": (64, 64), "green": (50, 30)}  # name -> (width, height)


def image_png(name: str) -> bytes:
    """The PNG bytes of test image `name` (one of SIZES)."""
    width, height = SIZES[name]
    rng = np.random.default_rng(sorted(SIZES).index(name))
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], axis=-1)
    pixels = (pixels + rng.integers(0, 256, 3)) % 256
    for _ in range(4):
        x0, y0 = rng.integers(0, width - 8), rng.integers(0, height - 8)
        pixels[y0 : y0 + rng.integers(4, 16), x0 : x0 + rng.integers(4, 16)] = rng.integers(0, 256, 3)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()
