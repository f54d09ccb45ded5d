"""A prompt with images: its token ids and where each image's soft tokens sit (no JAX here).

A chat's image parts are rendered as the model's image placeholder (Gemma 3: `<start_of_image>`);
`expand_images` then does what Gemma 3's processor does: every placeholder in the rendered text
becomes `\\n\\n<start_of_image>` + `mm_tokens_per_image` x `<image_soft_token>` + `<end_of_image>\\n\\n`,
and the text is tokenized. The rows of soft tokens (`PromptImage`) take the projector's outputs
instead of token embeddings, attend to each other both ways, and are keyed in the prefix cache by
the image's digest (`salt_cache_tokens`), so the same text with another image never hits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxserve.images import ImageInput


class VisionTokens(Protocol):
    """What a prompt's expansion needs of a vision tower's config (`gemma3_vision.VisionConfig`)."""

    mm_tokens_per_image: int
    boi_token_id: int
    eoi_token_id: int
    image_token_id: int


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt (or one tile of it): its soft tokens are prompt positions
    [start, start + length); `bidirectional`: they attend to each other both ways (Gemma 3), so a
    prefill chunk never ends inside them; else causally, like text (Idefics3 / SmolVLM)."""

    start: int
    length: int
    image: ImageInput
    bidirectional: bool = True

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclasses.dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    """Token ids (a rendered chat's, with its BOS) and the images whose soft tokens they hold."""

    token_ids: list[int]
    images: tuple[PromptImage, ...]


def expand_images(
    text: str, images: Sequence[ImageInput], tokenizer: TextTokenizer, vision: VisionTokens
) -> MultimodalPrompt:
    """The prompt of rendered `text` whose image placeholders stand for `images`, in order
    (ValueError when their numbers differ)."""
    placeholder = tokenizer.decode([vision.boi_token_id], skip_special_tokens=False)
    soft = tokenizer.decode([vision.image_token_id], skip_special_tokens=False)
    end = tokenizer.decode([vision.eoi_token_id], skip_special_tokens=False)
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders for {len(images)} images")
    full = f"\n\n{placeholder}{soft * vision.mm_tokens_per_image}{end}\n\n"
    ids = tokenizer.encode(full.join(pieces), add_special_tokens=False)
    return MultimodalPrompt(ids, image_spans(ids, images, vision))


def image_spans(ids: Sequence[int], images: Sequence[ImageInput], vision: VisionTokens) -> tuple[PromptImage, ...]:
    """Where each image's soft tokens are in `ids`: runs of `mm_tokens_per_image` image tokens,
    one per image (ValueError for a prompt that does not hold exactly those)."""
    is_soft = np.asarray(ids) == vision.image_token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[False], is_soft, [False]]).astype(np.int8)))
    starts, ends = edges[::2], edges[1::2]
    if len(starts) != len(images) or np.any(ends - starts != vision.mm_tokens_per_image):
        raise ValueError(
            f"the prompt's image tokens do not hold {len(images)} images of {vision.mm_tokens_per_image} tokens each"
        )
    return tuple(PromptImage(int(s), vision.mm_tokens_per_image, image) for s, image in zip(starts, images))


def salt_cache_tokens(ids: list[int], images: Sequence[PromptImage]) -> None:
    """Replace, in place, the soft tokens among `ids` (a prefix of the prompt) by ids drawn from their
    image's digest, as the prefix cache keys them (`salt_rows`)."""
    for image in images:
        salt_rows(ids, image.start, image.end, image.image.digest)


def salt_rows(ids: list[int], start: int, end: int, digest: bytes) -> None:
    """Replace, in place, `ids[start:end]` (as far as `ids` goes) by ids drawn from `digest`: negative,
    so never a real token; 31 bits of the digest each, in turn, so an image of 4 or more soft tokens
    is keyed by 124 bits of it."""
    words = np.frombuffer(digest, np.uint32) & 0x7FFFFFFF
    for k in range(start, min(end, len(ids))):
        ids[k] = -1 - int(words[(k - start) % len(words)])


def cache_token_ids(ids: Sequence[int], images: Sequence[PromptImage]) -> list[int]:
    """A copy of `ids` as the prefix cache keys them: its images' soft tokens salted by their digests."""
    salted = list(ids)
    salt_cache_tokens(salted, images)
    return salted


def chunk_end(images: Sequence[PromptImage], start: int, n: int) -> int:
    """Tokens from `start` that a prefill chunk of at most `n` may take so that it ends at no
    position inside a bidirectional image (its rows attend to each other both ways, so the whole
    image is computed in one step): fewer than `n` when it would split one, 0 when it starts inside or at
    one that does not fit."""
    stop = start + n
    for image in images:
        if image.bidirectional and image.start < stop < image.end:
            return image.start - start if image.start > start else 0
    return n
