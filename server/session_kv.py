"""Pins each session's latest history in the prefix cache, within the owner's block budget.

All KV work runs on the engine thread (through the engine's pin methods). A session lives on one
data-parallel replica (the router keeps it there), and its pin is in that replica's cache.
When a new pin does not fit the owner's budget, the owner's least recently used other
sessions on that replica give up their pins until it fits (they still work; their next turn
may recompute part of the history).
"""

from __future__ import annotations

from jaxserve.engine_client import EngineClient, Pin
from server.sessions import Session, SessionStore


class SessionKV:
    def __init__(self, engine: EngineClient, store: SessionStore) -> None:
        self.engine = engine
        self.store = store

    async def set_budget(self, blocks_per_owner: int) -> None:
        await self.engine.set_pin_budget(blocks_per_owner)

    async def pin_history(self, session: Session, ids: list[int]) -> None:
        """Pin the cached blocks of `ids` for the session, replacing its previous pin."""
        others = [s for s in self.store.owned_by(session.owner) if s is not session and s.pin is not None]
        others.sort(key=lambda s: s.last_used)
        by_pin = {id(s.pin): s for s in others}
        old = session.pin
        result = await self.engine.pin_history(session.id, session.owner, ids, old, [s.pin for s in others])
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
            await self.engine.end_sessions([(session.id, pin)])
        elif session.pin is old:
            session.pin = pin
        elif pin is not None:  # re-pinned meanwhile: drop this pin
            await self.engine.unpin(pin)

    async def end(self, session: Session) -> None:
        """The session is gone: release its pin and its place on a replica."""
        await self.end_all([session])

    async def end_all(self, sessions: list[Session]) -> None:
        """`end` for several sessions, in one call on the engine thread."""
        ended: list[tuple[str, Pin | None]] = [(session.id, session.pin) for session in sessions]
        for session in sessions:
            session.pin = None
        await self.engine.end_sessions(ended)
