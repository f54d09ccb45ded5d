"""A target's prefix cache as its KV events tell it (`jaxserve.kv.kv_events`): the content keys of
the blocks it holds. A router that follows a worker's events places by this instead of by what it
sent there (`SentPrefixes`), so a prefix another router sent, or one the worker read from the KV
pool, counts too."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxserve.kv.content_keys import content_token_bytes, next_key


class KVIndex:
    def __init__(self, seed: bytes, block_size: int, keys: Iterable[bytes]) -> None:
        if block_size <= 0:
            raise ValueError(f"a KV event snapshot needs a block size, got {block_size}")
        self.seed = seed
        self.block_size = block_size
        self.keys = set(keys)

    def apply(self, stored: Iterable[bytes], removed: Iterable[bytes], cleared: bool) -> None:
        """One batch of changes, in order: cleared first, then stored, then removed."""
        if cleared:
            self.keys.clear()
        self.keys.update(stored)
        self.keys.difference_update(removed)

    def match(self, token_ids: Sequence[int], salt: bytes | None = None) -> int:
        """Tokens of `token_ids` from the start whose blocks the target holds (whole blocks); `salt`:
        a LoRA adapter's weights digest, whose requests' keys chain from the seed salted by it
        (`ChainKeys.salted`)."""
        bs, n = self.block_size, 0
        key = self.seed if salt is None else next_key(self.seed, salt)
        while (n + 1) * bs <= len(token_ids):
            key = next_key(key, content_token_bytes(token_ids, n * bs, (n + 1) * bs))
            if key not in self.keys:
                break
            n += 1
        return n * bs
