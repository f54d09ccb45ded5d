"""The encoder budget of one step: at most `max_num_encoder_images` images (vision tower inputs: a
Gemma 3 image, one tile of a SmolVLM picture) encoded for the step's prefill chunks, as vLLM's
`max_num_encoder_input_tokens` bounds its encoder's work per step (every input of a tower has the same
number of patches, so counting inputs counts patches).

An image whose soft tokens a chunk holds costs one unless the encoder cache holds it (by digest) or
another chunk of the step already pays for it. A chunk stops before the first image that does not fit
in what is left (`chunk_end`), and the rest of its prompt waits for a later step; the first image of
a step always fits (the budget is at least 1), so every prompt goes on. A chunk that must hold the rest
of its prompt (without chunked prefill; or while `max_num_partial_prefills` prompts are being chunked,
a waiting prompt's) runs whole or not at all: one whose images are more than the budget runs alone, in
a step that encodes nothing else (`cut`).

No JAX here.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from jaxserve.image_prompt import PromptImage

EncodedImages = Container[bytes]  # digests of the images the encoder cache holds


class EncoderBudget:
    """What a step's chunks may have encoded, and what they have taken so far."""

    def __init__(self, limit: int | None, encoded: EncodedImages, chunked_prefill: bool = True) -> None:
        self.limit = limit  # None: no budget
        self.encoded = encoded  # the encoder cache (digests of images encoded already)
        self.chunked_prefill = chunked_prefill  # off: a prompt runs whole
        self.digests: set[bytes] = set()  # the images this step encodes

    def _new(self, images: Sequence[PromptImage], start: int, stop: int) -> list[PromptImage]:
        """The images holding positions in [start, stop) that this step would encode besides its own."""
        return [
            i
            for i in images
            if i.start < stop
            and start < i.end
            and i.image.digest not in self.encoded
            and i.image.digest not in self.digests
        ]

    def chunk_end(self, images: Sequence[PromptImage], start: int, n: int) -> int:
        """Tokens from `start` (at most `n`) of a chunk whose new images fit in what is left: it stops
        before the first that does not fit (0: it starts at or inside that image)."""
        if self.limit is None:
            return n
        left = self.limit - len(self.digests)
        seen: set[bytes] = set()
        for image in self._new(images, start, start + n):  # in prompt order
            if image.image.digest not in seen and len(seen) >= left:
                return max(image.start - start, 0)
            seen.add(image.image.digest)
        return n

    def cut(self, images: Sequence[PromptImage], start: int, n: int, may_split: bool = True) -> int:
        """`chunk_end`, or all or nothing for a chunk that must hold the rest of its prompt (without chunked
        prefill, or when not `may_split`: more prompts may not be left partly computed): `n` while nothing
        else of this step is encoded (over the budget, alone), else 0."""
        end = self.chunk_end(images, start, n)
        if end == n or (self.chunked_prefill and may_split):
            return end
        return 0 if self.digests else n

    def take(self, images: Sequence[PromptImage], start: int, n: int) -> None:
        """A chunk of positions [start, start + n) is scheduled: its new images are this step's."""
        self.digests.update(i.image.digest for i in self._new(images, start, start + n))
