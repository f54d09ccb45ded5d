"""The KV manager's answer to "what of this prompt is cached" (`KVCacheManager.match_prefix`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.kv.content_keys import ChainKeys
from jaxserve.kv.prefix_cache import CachedPath, PrefixMatch


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached prefix of a prompt; pass it to `admit` (or `loads.start`) before the manager
    changes (`epoch`), or match again."""

    match: PrefixMatch  # the prefix cache's part: device blocks, then host blocks
    num_prompt_tokens: int
    epoch: int  # the manager's change count when matched
    chain: ChainKeys | None  # the prompt's content keys, with a tier below the host (computed as far as asked)
    token_ids: Sequence[int] | np.ndarray
    num_disk_tokens: int = 0  # after num_tokens: blocks in the tier below the host, the disk (`TierLoads.start`)

    @property
    def num_tokens(self) -> int:
        """Prompt tokens whose KV is cached (device + host)."""
        return self.match.num_tokens

    @property
    def num_host_tokens(self) -> int:
        """The part of num_tokens that is copied back from the host tier."""
        return self.match.num_host_tokens

    @property
    def path(self) -> CachedPath:
        return self.match.path

    @property
    def device_blocks(self) -> list[int]:
        return self.match.device_blocks
