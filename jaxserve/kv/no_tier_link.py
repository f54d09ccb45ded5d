"""The link of a KV manager with no tier below the host tier (no disk tier): nothing is stored
below, so every lookup finds nothing, every write and load is a no-op, and the manager and
`TierLoads` need not ask which link they have (as `NoPrefixCache` stands for no prefix cache).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from jaxserve.kv.content_keys import KEY_BYTES, ChainKeys, PathSeeds
from jaxserve.kv.prefix_cache import CachedPath
from jaxserve.kv.tier_link import LoadStart


class NoTierLink:
    """A `LowerTierLink` to a tier that holds nothing."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seeds = PathSeeds(bytes(KEY_BYTES))

    def new_chain(self) -> ChainKeys:
        """Keys with a zero seed: no tier's weights fingerprint to seed them with."""
        return ChainKeys(self.seeds.seed, self.block_size)

    def blocks_stored(self, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, first: int, limit: int) -> int:
        return 0

    def write_through(self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray, blocks: dict[int, int]) -> None:
        pass

    def count_hits(self, chain: ChainKeys, tokens: Sequence[int] | np.ndarray, device_blocks: Sequence[int]) -> None:
        pass

    def flush(self) -> int:
        return 0

    def start_load(
        self, req_id: Hashable, path: CachedPath, tokens: Sequence[int] | np.ndarray, chain: ChainKeys, num_blocks: int
    ) -> LoadStart:
        return LoadStart.NONE

    def submit(self) -> None:
        pass

    def poll(self) -> bool:
        return False

    def is_loading(self, req_id: Hashable) -> bool:
        return False

    @property
    def has_pending(self) -> bool:
        return False

    def release(self, req_id: Hashable, admitted_tokens: int) -> None:
        pass

    def locked_paths(self) -> list[CachedPath]:
        return []

    def held_host_slots(self) -> list[int]:
        return []

    def check_integrity(self) -> None:
        pass

    def tier_stats(self) -> dict[str, Any]:
        return {}
