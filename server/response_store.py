"""Stored responses of the Responses API, kept as sessions (`server.sessions`).

A stored response is a session whose messages are the conversation it ends (the previous
response's, then its input, then its reply; never the `instructions`, which OpenAI does not carry
over) and whose `response` holds what the API shows of it. So it gets what sessions get: one key
sees only its own (another key's id is a 404), every change is written atomically before it is
visible when there is a `--session-dir` (a response survives a restart; a file that does not load
is quarantined), idle ones expire (`--response-ttl`), and the KV of the newest response of a
chain stays pinned within the key's budget: a response that continues another takes over its pin
and the chain stays on the replica or worker that holds it (`SessionKV`). Each key keeps at most
`--max-stored-responses-per-key`; beyond that, its least recently used idle ones are deleted.
"""

from __future__ import annotations

import logging
from typing import Any

from server.errors import APIError
from server.session_files import RESPONSE_PREFIX
from server.session_kv import SessionKV
from server.sessions import Message, Session, SessionStore, new_session_id

logger = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")


def new_response_id() -> str:
    return new_session_id(RESPONSE_PREFIX)


class ResponseStore:
    def __init__(self, sessions: SessionStore, session_kv: SessionKV, max_per_owner: int) -> None:
        self.sessions = sessions
        self.session_kv = session_kv
        self.max_per_owner = max_per_owner

    def get(self, owner: str, response_id: str, param: str | None = None) -> Session:
        """The owner's stored response, or 404."""
        session = self.sessions.find(owner, response_id, responses=True)
        if session is None:
            raise APIError(404, f"no stored response with id {response_id!r}", param=param, code="response_not_found")
        return session

    def previous(self, owner: str, response_id: str) -> Session:
        """The stored response a new one continues: 404 if there is none, 409 while it runs."""
        session = self.get(owner, response_id, param="previous_response_id")
        if session.busy or session.response["object"]["status"] in UNFINISHED:
            raise APIError(
                409,
                f"the response {response_id!r} is still in progress",
                param="previous_response_id",
                code="response_in_progress",
            )
        return session

    async def create(
        self, owner: str, model: str, response_id: str, messages: list[Message], record: dict[str, Any]
    ) -> Session:
        """Store a response (written first with files; APIError 500 when that fails), deleting
        the owner's least recently used idle ones beyond the limit."""
        stored = self.sessions.owned_by(owner, responses=True)
        excess = len(stored) + 1 - self.max_per_owner
        for old in sorted((s for s in stored if not s.busy), key=lambda s: s.last_used)[: max(excess, 0)]:
            logger.info("deleting stored response %s: its key keeps at most %d", old.id, self.max_per_owner)
            await self.remove(old)
        return self.sessions.create(owner, model, messages, {}, response=record, session_id=response_id)

    async def remove(self, session: Session) -> None:
        self.sessions.remove(session)
        await self.session_kv.end(session)

    @staticmethod
    def public(session: Session) -> dict[str, Any]:
        """The response as the API shows it; one left unfinished by a server that stopped is failed."""
        body = session.response["object"]
        if body["status"] in UNFINISHED and not session.busy:
            return {
                **body,
                "status": "failed",
                "error": {"code": "server_error", "message": "the server stopped before the response finished"},
            }
        return body
