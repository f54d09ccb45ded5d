"""Holds: a prompt's cached full blocks kept on the device while they move between workers.

Prefill/decode disaggregation hands a prompt's KV from one engine to another. The prefill side
holds the prompt's blocks (`KVCacheManager.hold_prefix`) until the decode side has read them
(a lease, released on ack, timeout or abort); the decode side holds what it already had while
it pulls the rest, writes the pulled bytes into blocks it allocates (`allocate_import`), adds
them to its prefix cache (`adopt_import`) and keeps the path held until the request is
admitted. A hold locks a device path of the prefix cache, as a pin does, but counts against
no session budget: it lives seconds, not a session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.kv.radix_cache import RadixNode


@dataclass(eq=False)
class Hold:
    """A locked device path of the prefix cache: `blocks` hold the KV of the first
    `len(blocks) * block_size` tokens of the prompt it was made for."""

    blocks: list[int]
    node: RadixNode | None = field(repr=False, default=None)
    active: bool = True

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)
