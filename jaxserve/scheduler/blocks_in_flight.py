"""The prompt blocks this step's prefills compute, for a later request of the same step to wait for
(one step, then it hits the prefix cache) instead of computing them twice."""

from __future__ import annotations

from jaxserve.request import Request


class BlocksInFlight:
    """Content keys (`Request.block_keys`) of the full prompt blocks this step's prefills compute.
    Keys are computed when first asked for (`holds`), so a step that schedules one prefill, or that
    no later request asks about, computes none."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._added: list[tuple[Request, int, int]] = []  # (request, first block, end block)
        self._keys: set[bytes] = set()

    def __bool__(self) -> bool:
        return bool(self._added or self._keys)

    def add(self, req: Request, first: int, end: int) -> None:
        """`req`'s prompt blocks [first, end) are computed this step."""
        self._added.append((req, first, end))

    def holds(self, req: Request, block: int) -> bool:
        """Whether `req`'s prompt block `block` (full) is one this step computes for another request."""
        bs = self.block_size
        for other, first, end in self._added:
            self._keys.update(other.block_keys.keys(other.copy_cache_tokens(end * bs), end)[first:])
        self._added.clear()
        return req.block_keys.keys(req.copy_cache_tokens((block + 1) * bs), block + 1)[block] in self._keys
