"""The image rows of a vision-language model's prefill programs (host side): which rows take an
image's soft-token embedding, and how far each row attends (`AttentionMetadata.visible_until`),
from the encoder cache that `VisionEncoder.encode_step` filled for the step."""

from __future__ import annotations

import collections

import numpy as np

from jaxserve.model.image_rows import ImageRows
from jaxserve.scheduler.output import ScheduledChunk


class EncoderCache:
    """Soft-token embeddings [mm_tokens_per_image, hidden_size] f32 by image digest, the least
    recently used out first once more than `capacity` are kept."""

    def __init__(self, capacity: int, hidden_size: int, bidirectional: bool = True) -> None:
        self.capacity = capacity
        self.hidden_size = hidden_size
        self.bidirectional = bidirectional  # its model's image rows attend both ways (`visible_until`)
        self._entries: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.hits = self.misses = 0  # images a step found here, and those it encoded

    def get(self, digest: bytes) -> np.ndarray | None:
        found = self._entries.get(digest)
        if found is not None:
            self._entries.move_to_end(digest)
        return found

    def put(self, digest: bytes, embeddings: np.ndarray) -> None:
        self._entries[digest] = embeddings
        self._entries.move_to_end(digest)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: object) -> bool:
        """Whether it holds the image (without making it the most recently used)."""
        return digest in self._entries


def with_image_rows(host_args: tuple, chunks: list[ScheduledChunk], cache: EncoderCache | None) -> tuple:
    """A prefill program's host arguments (tokens, positions, meta, ...), with its image rows after
    them and (images attended both ways) its rows' `visible_until` in the meta, when `cache` is a
    vision-language model's encoder cache (holding the chunks' images); unchanged when it is None."""
    if cache is None:
        return host_args
    positions, meta = host_args[1], host_args[2]
    rows, visible_until = image_rows(chunks, positions, cache)
    if cache.bidirectional:
        meta.visible_until = visible_until
    return (*host_args, rows)


def image_rows(
    chunks: list[ScheduledChunk], positions: np.ndarray, cache: EncoderCache
) -> tuple[ImageRows, np.ndarray]:
    """The image rows of a prefill program whose first rows are `chunks`' (in order) at `positions`
    [T], and each row's last visible position: its own, or its image's last for an image's rows."""
    rows = ImageRows(np.zeros((len(positions), cache.hidden_size), np.float32), np.zeros(len(positions), np.bool_))
    visible_until = positions.copy()
    row = 0
    for c in chunks:
        stop = c.start + c.num_new_tokens
        for image in c.request.images:
            first, last = max(image.start, c.start), min(image.end, stop)
            if first >= last:
                continue
            at = slice(row + first - c.start, row + last - c.start)
            rows.embeds[at] = cache.get(image.image.digest)[first - image.start : last - image.start]
            rows.is_image[at] = True
            if image.bidirectional:
                visible_until[at] = min(image.end, stop) - 1  # the scheduler never splits such an image
        row += c.num_new_tokens
    return rows, visible_until
