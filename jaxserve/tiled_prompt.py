"""A prompt with Idefics3 / SmolVLM images: each `<image>` of the rendered chat expanded into the
markers and rows of its tiles (no JAX here), as the models' processors do it.

An image of `rows` x `cols` tiles becomes, row by row, `<fake_token_around_image><row_r_col_c>`
+ `image_seq_len` x `<image>` per tile, a newline after each row, then a newline and the global
image: `<fake_token_around_image><global-img>` + its rows + `<fake_token_around_image>`; an image
of one tile is only the global part. Each tile is a `PromptImage` of its own (its rows take the
connector's outputs for that tile; the language model attends to them causally, so a prefill
chunk may end inside one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxserve.image_prompt import MultimodalPrompt, PromptImage, TextTokenizer
from jaxserve.tiled_images import TiledImage

# The processor's markers around an image's tokens (the tokenizer's special tokens of these names).
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


class TileTokens(Protocol):
    """What a prompt's expansion needs of a vision tower's config (`idefics3_vision.VisionConfig`)."""

    image_token_id: int
    mm_tokens_per_image: int  # rows of one tile (the processor's `image_seq_len`)


def image_text(image: TiledImage, image_token: str, seq_len: int) -> str:
    """The text that stands for one image's tiles."""
    rows = image_token * seq_len
    tiles = "".join(
        "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{rows}" for c in range(image.cols)) + "\n"
        for r in range(image.rows)
    )
    glue = "\n" if image.rows else ""
    return f"{tiles}{glue}{FAKE_TOKEN}{GLOBAL_TOKEN}{rows}{FAKE_TOKEN}"


def expand_tiled(
    text: str, images: Sequence[TiledImage], tokenizer: TextTokenizer, vision: TileTokens
) -> MultimodalPrompt:
    """The prompt of rendered `text` whose `<image>` placeholders stand for `images`, in order
    (ValueError when their numbers differ)."""
    placeholder = tokenizer.decode([vision.image_token_id], skip_special_tokens=False)
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders for {len(images)} images")
    parts = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        parts += [image_text(image, placeholder, vision.mm_tokens_per_image), piece]
    ids = tokenizer.encode("".join(parts), add_special_tokens=False)
    return MultimodalPrompt(ids, tile_spans(ids, images, vision))


def tile_spans(ids: Sequence[int], images: Sequence[TiledImage], vision: TileTokens) -> tuple[PromptImage, ...]:
    """Where each tile's rows are in `ids`: runs of `mm_tokens_per_image` image tokens, one per tile
    in order (ValueError for a prompt that does not hold exactly those)."""
    tiles = [tile for image in images for tile in image.tiles]
    is_row = np.asarray(ids) == vision.image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[False], is_row, [False]]).astype(np.int8)))
    starts, ends = edges[::2], edges[1::2]
    seq_len = vision.mm_tokens_per_image
    if len(starts) != len(tiles) or np.any(ends - starts != seq_len):
        raise ValueError(f"the prompt's image tokens do not hold {len(tiles)} tiles of {seq_len} tokens each")
    return tuple(PromptImage(int(s), seq_len, tile, bidirectional=False) for s, tile in zip(starts, tiles))
