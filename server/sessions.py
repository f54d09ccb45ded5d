"""Conversation sessions: messages owned by one API key, with idle expiry and optional files.

A session never leaks across keys: looking up another key's session is indistinguishable from
looking up one that does not exist (404). Runtime state (the reply in flight, the KV pin) is
not persisted; messages, sampling defaults and the token memo are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from server.errors import APIError, not_found
from server.session_files import SessionFiles
from server.token_memo import TokenMemo

if TYPE_CHECKING:
    from jaxserve.kv import Pin
    from server.generation import Generation

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Session:
    id: str
    owner: str
    model: str
    messages: list[dict[str, str]]
    defaults: dict[str, Any]  # sampling parameters with chat-completion names
    memo: TokenMemo
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    last_used: float = dataclasses.field(default_factory=time.time)
    # Runtime only.
    reply: Generation | None = None  # the reply being generated
    reply_done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    pin: Pin | None = None

    @property
    def busy(self) -> bool:
        return self.reply is not None

    def touch(self) -> None:
        self.last_used = time.time()

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "session",
            "created_at": self.created_at,
            "last_used_at": int(self.last_used),
            "model": self.model,
            "defaults": dict(self.defaults),
            "messages": [dict(m) for m in self.messages],
            "replying": self.busy,
        }

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "owner": self.owner,
            "model": self.model,
            "created_at": self.created_at,
            "last_used": self.last_used,
            "defaults": self.defaults,
            "messages": self.messages,
            "memo": self.memo.to_json(),
        }

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> Session:
        return cls(
            id=str(r["id"]),
            owner=str(r["owner"]),
            model=str(r["model"]),
            messages=[{"role": str(m["role"]), "content": str(m["content"])} for m in r["messages"]],
            defaults=dict(r.get("defaults", {})),
            memo=TokenMemo.from_json(r.get("memo", [])),
            created_at=int(r["created_at"]),
            last_used=float(r["last_used"]),
        )


class SessionStore:
    def __init__(self, max_per_owner: int, ttl: float, files: SessionFiles | None = None) -> None:
        self.max_per_owner = max_per_owner
        self.ttl = ttl
        self.files = files
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def load(self) -> int:
        """Read the sessions saved on disk (after a restart); returns how many."""
        if self.files is None:
            return 0
        for record in self.files.load_all():
            try:
                session = Session.from_record(record)
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("skipping a malformed session record: %r", e)
                continue
            self._sessions[session.id] = session
        return len(self._sessions)

    def create(self, owner: str, model: str, messages: list[dict[str, str]], defaults: dict[str, Any],
               memo: TokenMemo | None = None) -> Session:
        if sum(1 for s in self._sessions.values() if s.owner == owner) >= self.max_per_owner:
            raise APIError(429, f"this key already has {self.max_per_owner} sessions; delete some first",
                           code="session_limit_reached")
        session = Session(
            id="sess_" + secrets.token_hex(12),
            owner=owner,
            model=model,
            messages=[dict(m) for m in messages],
            defaults=dict(defaults),
            memo=memo.copy() if memo is not None else TokenMemo(),
        )
        self._sessions[session.id] = session
        self.save(session)
        return session

    def get(self, owner: str, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise not_found(f"no session {session_id!r}", code="session_not_found")
        return session

    def owned_by(self, owner: str) -> list[Session]:
        return sorted((s for s in self._sessions.values() if s.owner == owner), key=lambda s: s.created_at)

    def contains(self, session: Session) -> bool:
        return self._sessions.get(session.id) is session

    def remove(self, session: Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
            if self.files is not None:
                self.files.delete(session.id)

    def save(self, session: Session) -> None:
        """Write the session to disk (if persistence is on and it was not deleted meanwhile)."""
        if self.files is not None and self.contains(session):
            self.files.save(session.record())

    def expired(self, now: float | None = None) -> list[Session]:
        now = time.time() if now is None else now
        return [s for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl]
