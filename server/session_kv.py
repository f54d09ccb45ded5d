"""Pins each session's latest history in the prefix cache, within the owner's block budget.

All KV work runs on the engine thread (through the engine's pin methods). A session lives on one
data-parallel replica (the router keeps it there), and its pin is in that replica's cache.
When a new pin does not fit the owner's budget, the owner's least recently used other
sessions on that replica give up their pins until it fits (they still work; their next turn
may recompute part of the history).

Stored responses are sessions whose chain (`Session.placement_id`) stays on one replica: a
response that continues another takes over its pin (the newer history holds the older one), and
the chain's place is forgotten once its last stored response is gone.
"""

from __future__ import annotations

from jaxserve.engine_client import EngineClient, Pin
from server.sessions import Session, SessionStore


class SessionKV:
    def __init__(self, engine: EngineClient, store: SessionStore, base_model: str) -> None:
        self.engine = engine
        self.store = store
        self.base_model = base_model  # the served name: a session of any other model runs a LoRA adapter

    async def set_budget(self, blocks_per_owner: int) -> None:
        await self.engine.set_pin_budget(blocks_per_owner)

    async def pin_history(self, session: Session, ids: list[int], replacing: Session | None = None) -> None:
        """Pin the cached blocks of `ids` for the session, replacing its previous pin (or the pin
        of `replacing`, a stored response it continues)."""
        holder_of_old = session if replacing is None else replacing
        others = [
            s
            for s in self.store.owned_by(session.owner, kind=None)
            if s is not session and s is not holder_of_old and s.pin is not None
        ]
        others.sort(key=lambda s: s.last_used)
        by_pin = {id(s.pin): s for s in others}
        old = holder_of_old.pin
        lora = None if session.model == self.base_model else session.model
        result = await self.engine.pin_history(
            session.placement_id, session.owner, ids, old, [s.pin for s in others], lora
        )
        if result is None:
            return
        pin, released = result
        for p in released:
            holder = by_pin.get(id(p))
            if holder is not None and holder.pin is p:
                holder.pin = None
        if replacing is not None and old is not None and not old.active and replacing.pin is old:
            replacing.pin = None  # replaced by the new pin (or released with it)
        if not self.store.contains(session):
            # Deleted while the pin was being made: `end` ran before this pin existed, so release
            # it here, and the session's place on its replica that pinning registered again.
            await self.end_all([session], extra_pin=pin)
        elif session.pin is (old if replacing is None else None):
            session.pin = pin
        elif pin is not None:  # re-pinned meanwhile: drop this pin
            await self.engine.unpin(pin)

    async def end(self, session: Session) -> None:
        """The session is gone: release its pin and its place on a replica."""
        await self.end_all([session])

    async def end_all(self, sessions: list[Session], extra_pin: Pin | None = None) -> None:
        """`end` for several sessions, in one call on the engine thread; a stored response's
        chain keeps its place while another of its responses is stored (only its pin goes)."""
        gone = {id(s) for s in sessions}
        kept = {s.placement_id for s in self.store.all() if id(s) not in gone}
        ended: list[tuple[str, Pin | None]] = []
        unpins = [] if extra_pin is None else [extra_pin]
        for session in sessions:
            pin, session.pin = session.pin, None
            if session.placement_id in kept:
                if pin is not None:
                    unpins.append(pin)
            else:
                kept.add(session.placement_id)
                ended.append((session.placement_id, pin))
        for pin in unpins:
            await self.engine.unpin(pin)
        await self.engine.end_sessions(ended)
