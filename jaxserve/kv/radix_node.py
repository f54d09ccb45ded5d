"""The nodes of the radix prefix cache (`radix_cache.py`)."""

from __future__ import annotations


class RadixNode:
    """One run of blocks in the tree. Opaque to users: hold it to unlock what you locked."""

    __slots__ = ("parent", "children", "key", "start", "length", "blocks", "host_slots", "lock")

    def __init__(
        self,
        parent: RadixNode | None,
        key: bytes,
        start: int,
        length: int,
        blocks: list[int] | None,
        host_slots: list[int] | None,
        lock: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.key = key
        self.start = start  # blocks on the path before this node
        self.length = length  # blocks in this node
        self.blocks = blocks  # device blocks, or None when the node lives on the host
        self.host_slots = host_slots
        self.lock = lock  # locks on this node or any descendant

    @property
    def end(self) -> int:
        """Blocks on the path up to and including this node."""
        return self.start + self.length

    @property
    def on_device(self) -> bool:
        return self.blocks is not None
