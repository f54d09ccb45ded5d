"""The interface of a shared store of byte objects (`BlockStore`) that the pool tier keeps KV blocks in.

A store moves objects by string key between itself and host memory the caller registered with it,
in batches (one round trip to the store per batch). `jaxserve.mooncake_store.MooncakeBlockStore`
implements it on Mooncake Store, whose pool spans the memory that every worker (or a
`mooncake_client` process) lends it.

Results are per key, as the store reports them: a count of bytes (or 1/0 for `exists`) when it
worked, else one of the negative codes below. `UNAVAILABLE` means the store could not be asked
(its master is down or unreachable): the pool tier then stops asking until a probe succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

MISSING = -1  # no object under the key (never stored, or evicted by the pool)
FULL = -2  # the pool has no room for the object now
UNAVAILABLE = -3  # the store could not be reached
FAILED = -4  # any other failure of this object's transfer


@runtime_checkable
class BlockStore(Protocol):
    def register(self, address: int, nbytes: int) -> None:
        """Make `nbytes` of host memory at `address` a source and destination of transfers."""

    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 stored, 0 not, or a negative code."""

    def put(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Store object i from `sizes[i]` bytes at `addresses[i]` (registered memory); per key 0 or a negative code."""

    def get(self, keys: Sequence[str], addresses: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Read object i into the registered ranges `sizes[i][j]` bytes at `addresses[i][j]`, filled in
        order (its header to one place, its K and V to others); per key the bytes read or a negative code."""

    def close(self) -> None:
        """Leave the pool (the memory this process lent it goes with it). Idempotent."""
