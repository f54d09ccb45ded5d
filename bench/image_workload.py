"""The `images` workload of `jaxserve bench serve`: chat prompts with 1 to `max_images` images each
(a vision-language model's; the server must serve one, as docs/vision.md says).

Request i carries 1 + i % max_images images, so every count is sent equally often and each request
is reported in its group (`1-images`, `2-images`, ...); its text is `input_len` random tokens. The
images are random PNGs of `image_side` pixels drawn from the seed, new for every request (no
encoder or prefix cache hit between requests). They go as data URLs in `image_url` parts, before
the text (`bench.load` sends an item with images through chat completions).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from bench.workloads import BenchRequest, TokenSampler, WorkItem, Workload


def random_png(rng: np.random.Generator, side: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB").save(out, format="PNG")
    return out.getvalue()


def image_workload(
    sampler: TokenSampler, num_prompts: int, input_len: int, output_len: int, max_images: int = 4, image_side: int = 64
) -> Workload:
    if max_images < 1:
        raise ValueError("max_images must be >= 1")
    rng = np.random.default_rng(sampler.rng.integers(1 << 31))
    items: list[WorkItem] = []
    for i in range(num_prompts):
        count = 1 + i % max_images
        text = sampler.tokenizer.decode(sampler.ids(input_len))
        images = tuple(random_png(rng, image_side) for _ in range(count))
        items.append(BenchRequest(text, output_len, input_len, f"{count}-images", images))
    params = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len}
    return Workload("images", items, {**params, "max_images": max_images, "image_side": image_side})
