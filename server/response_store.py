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

Conversations (the Conversations API) are stored the same way, with the same rules and the same
limit per key (counted apart from responses): a conversation's record holds the conversation
object and its items, and it is the chain (`Session.placement_id`) of the responses made in it,
whose KV it pins.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from server.errors import APIError
from server.session_files import CONVERSATION_PREFIX, RESPONSE_PREFIX
from server.session_kv import SessionKV
from server.sessions import Message, Session, SessionStore, new_session_id

logger = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")


def new_response_id() -> str:
    return new_session_id(RESPONSE_PREFIX)


def conversation_not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no conversation with id {conversation_id!r}", param=param, code="conversation_not_found")


class ResponseStore:
    def __init__(self, sessions: SessionStore, session_kv: SessionKV, max_per_owner: int) -> None:
        self.sessions = sessions
        self.session_kv = session_kv
        self.max_per_owner = max_per_owner

    def get(self, owner: str, response_id: str, param: str | None = None) -> Session:
        """The owner's stored response, or 404."""
        session = self.sessions.find(owner, response_id, "response")
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
        await self._make_room(owner, "response")
        return self.sessions.create(owner, model, messages, {}, response=record, session_id=response_id)

    def conversation(self, owner: str, conversation_id: str, param: str | None = None) -> Session:
        """The owner's conversation, or 404."""
        session = self.sessions.find(owner, conversation_id, "conversation")
        if session is None:
            raise conversation_not_found(conversation_id, param)
        return session

    async def create_conversation(
        self, owner: str, model: str, items: list[dict[str, Any]], metadata: dict[str, str]
    ) -> Session:
        """Store a new conversation (as `create` stores a response); `model` is the served model,
        until a response in it names another (its KV pin is that model's)."""
        await self._make_room(owner, "conversation")
        conversation_id = new_session_id(CONVERSATION_PREFIX)
        body = {"id": conversation_id, "object": "conversation", "created_at": int(time.time()), "metadata": metadata}
        record = {"object": body, "items": items, "chain": conversation_id}
        return self.sessions.create(owner, model, [], {}, response=record, session_id=conversation_id)

    def change_conversation(
        self, session: Session, items: list[dict[str, Any]] | None = None, metadata: dict[str, str] | None = None
    ) -> None:
        """Replace a conversation's items or metadata (written first; APIError 500, unchanged, when that fails)."""
        record = dict(session.response)
        if items is not None:
            record["items"] = items
        if metadata is not None:
            record["object"] = {**record["object"], "metadata": metadata}
        self.sessions.commit(session, session.messages, record)

    async def _make_room(self, owner: str, kind: str) -> None:
        """Delete the owner's least recently used idle responses or conversations (`kind`) beyond the limit."""
        stored = self.sessions.owned_by(owner, kind)
        excess = len(stored) + 1 - self.max_per_owner
        for old in sorted((s for s in stored if not s.busy), key=lambda s: s.last_used)[: max(excess, 0)]:
            logger.info("deleting stored %s %s: its key keeps at most %d", kind, old.id, self.max_per_owner)
            await self.remove(old)

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
