"""Pins each session's latest history in the prefix cache, within the owner's block budget.

All KV work runs on the engine thread (`AsyncEngine.call`). A session lives on one
data-parallel replica (the router keeps it there), and its pin is in that replica's cache.
When a new pin does not fit the owner's budget, the owner's least recently used other
sessions on that replica give up their pins until it fits (they still work; their next turn
may recompute part of the history).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from jaxserve.async_engine import AsyncEngine
from jaxserve.dp_router import DataParallelRouter
from jaxserve.kv import KVCacheManager, Pin
from server.sessions import Session, SessionStore

ENGINE_CALL_TIMEOUT = 30.0


async def engine_call(engine: AsyncEngine, fn: Callable[[DataParallelRouter], Any]) -> Any:
    """`engine.call(fn)`, or None when the engine loop is not running (shutting down)."""
    if not engine.is_alive:
        return None
    return await asyncio.wait_for(engine.call(fn), ENGINE_CALL_TIMEOUT)


def pin_within_budget(kv: KVCacheManager, owner: str, ids: list[int], old: Pin | None,
                      others: list[Pin]) -> tuple[Pin | None, list[Pin]]:
    """Runs on the engine thread: pin `ids` replacing `old`, unpinning `others` (LRU first) as
    needed. Returns the new pin (None if even alone it does not fit) and the pins released.
    `others` may hold pins of other replicas' caches: those are not `kv`'s to release."""
    others = [p for p in others if kv.pins.holds(p)]
    if old is not None and not old.active:
        old = None
    released = []
    pin = kv.pin(owner, ids, replacing=old)
    if pin is None and others and kv.prefix_cache is not None:
        needed = kv.prefix_cache.match(ids, leave_last_token=False).num_blocks
        if needed <= kv.pins.budget_per_owner:  # else hopeless even alone: keep the others
            for other in others:
                if not other.active:
                    continue
                kv.unpin(other)
                released.append(other)
                pin = kv.pin(owner, ids, replacing=old)
                if pin is not None:
                    break
    if pin is None and old is not None:
        kv.unpin(old)  # the old history is stale now; do not keep it pinned either
        released.append(old)
    return pin, released


def _unpin(router: DataParallelRouter, pin: Pin) -> None:
    for engine in router.replicas:
        if pin.active and engine.kv.pins.holds(pin):
            engine.kv.unpin(pin)


class SessionKV:
    def __init__(self, engine: AsyncEngine, store: SessionStore) -> None:
        self.engine = engine
        self.store = store

    async def set_budget(self, blocks_per_owner: int) -> None:
        def apply(router: DataParallelRouter) -> None:
            for engine in router.replicas:
                engine.kv.pins.budget_per_owner = blocks_per_owner

        await engine_call(self.engine, apply)

    async def pin_history(self, session: Session, ids: list[int]) -> None:
        """Pin the cached blocks of `ids` for the session, replacing its previous pin."""
        others = [s for s in self.store.owned_by(session.owner) if s is not session and s.pin is not None]
        others.sort(key=lambda s: s.last_used)
        by_pin = {id(s.pin): s for s in others}
        old = session.pin

        def pin(router: DataParallelRouter) -> tuple[Pin | None, list[Pin]]:
            kv = router.session_replica(session.id, ids).kv
            return pin_within_budget(kv, session.owner, ids, old, [s.pin for s in others])

        result = await engine_call(self.engine, pin)
        if result is None:
            return
        pin, released = result
        for p in released:
            holder = by_pin.get(id(p))
            if holder is not None and holder.pin is p:
                holder.pin = None
        if not self.store.contains(session):
            # Deleted while the pin was being made: `end` ran before this pin existed, so release
            # it here, and the session's place on its replica that pinning registered again.
            await self._release([(session.id, pin)])
        elif session.pin is old:
            session.pin = pin
        elif pin is not None:  # re-pinned meanwhile: drop this pin
            await engine_call(self.engine, lambda e: _unpin(e, pin))

    async def end(self, session: Session) -> None:
        """The session is gone: release its pin and its place on a replica."""
        await self.end_all([session])

    async def end_all(self, sessions: list[Session]) -> None:
        """`end` for several sessions, in one call on the engine thread."""
        ended = [(session.id, session.pin) for session in sessions]
        for session in sessions:
            session.pin = None
        await self._release(ended)

    async def _release(self, ended: list[tuple[str, Pin | None]]) -> None:
        def end(router: DataParallelRouter) -> None:
            for session_id, pin in ended:
                if pin is not None:
                    _unpin(router, pin)
                router.end_session(session_id)

        await engine_call(self.engine, end)
