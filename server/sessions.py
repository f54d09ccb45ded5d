"""Conversation sessions: messages owned by one API key, with idle expiry and optional files.

A session never leaks across keys: looking up another key's session is indistinguishable from
looking up one that does not exist (404). Runtime state (the reply in flight, the KV pin) is
not persisted; messages (assistant ones with the token ids the model generated, see
`server.prompts.encode_chat`) and sampling defaults are.

A stored response of the Responses API is a session too (`Session.response` holds what the API
shows of it, and its messages are the conversation it ends), and so is a conversation of the
Conversations API (`Session.response` holds the conversation and its items): they are kept,
written, quarantined, expired and pinned as sessions are, but listed, counted and looked up apart
from them, each kind by its id's prefix (`Session.kind`, `server.response_store`).

With files, every change is written before it becomes visible: `create`, `commit` and `remove`
write (or delete) the file first and change memory only once that succeeded, so a failed write
leaves the session, and the key's session count, as they were. Records read back at start-up
are checked field by field; one that does not pass is quarantined (see `SessionFiles`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any

from jaxserve.sampling_params import INT32_MAX, encodes_as_utf8
from server.errors import APIError, not_found
from server.session_files import CONVERSATION_PREFIX, RESPONSE_PREFIX, SESSION_ID, SESSION_PREFIX, SessionFiles

if TYPE_CHECKING:
    from jaxserve.engine_client import Pin
    from server.generation import Generation
    from server.response_background import EventLog

logger = logging.getLogger(__name__)

# {"role", "content"} and, on generated assistant messages, "token_ids"; assistant messages of a
# response may hold "tool_calls", and "tool" messages their "tool_call_id".
Message = dict[str, Any]
STORED_ROLES = frozenset({"system", "user", "assistant", "tool"})
KINDS = {SESSION_PREFIX: "session", RESPONSE_PREFIX: "response", CONVERSATION_PREFIX: "conversation"}
# What the `response` record of a stored response and of a conversation holds besides its
# "object" (what the API shows) and "chain" (where its KV lives): its items.
RECORD_ITEMS = {"response": "input_items", "conversation": "items"}


def _write_failed(error: OSError) -> APIError:
    logger.error("could not write a session file: %s", error)
    return APIError(500, "the session could not be saved; it is unchanged", code="session_write_failed")


@dataclasses.dataclass(eq=False)
class Session:
    id: str
    owner: str
    model: str
    messages: list[Message]
    defaults: dict[str, Any]  # sampling parameters with chat-completion names
    # A stored response: {"object": the response as the API shows it, "input_items": its input
    # items, "chain": the id of the first response of its chain}; a conversation: {"object",
    # "items", "chain": its own id}; None for a session.
    response: dict[str, Any] | None = None
    images: dict[str, str] = dataclasses.field(default_factory=dict)  # a session's image urls by key
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    last_used: float = dataclasses.field(default_factory=time.time)
    # Runtime only.
    reply: Generation | None = None  # the reply being generated
    reply_done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    pin: Pin | None = None
    events: EventLog | None = None  # a background response's stream (server.response_background)

    @property
    def kind(self) -> str:
        """ "session", "response" (a stored response) or "conversation", by the id's prefix."""
        return KINDS[self.id[: len(SESSION_PREFIX)]]

    @property
    def busy(self) -> bool:
        return self.reply is not None

    @property
    def placement_id(self) -> str:
        """What the engine keeps on one replica or worker: a session, a chain of responses, or a
        conversation (and the responses made in it)."""
        return self.id if self.response is None else self.response["chain"]

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "session",
            "created_at": self.created_at,
            "last_used_at": int(self.last_used),
            "model": self.model,
            "defaults": dict(self.defaults),
            "messages": [{"role": m["role"], "content": m["content"]} for m in self.messages],
            "replying": self.busy,
        }

    def record(
        self,
        messages: list[Message] | None = None,
        last_used: float | None = None,
        response: dict[str, Any] | None = None,
        images: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """What is written to disk: the session as it is, or with `messages`, `last_used`,
        `response` or `images` replaced."""
        record = {
            "id": self.id,
            "owner": self.owner,
            "model": self.model,
            "created_at": self.created_at,
            "last_used": self.last_used if last_used is None else last_used,
            "defaults": self.defaults,
            "messages": self.messages if messages is None else messages,
        }
        if self.response is not None or response is not None:
            record["response"] = self.response if response is None else response
        kept = self.images if images is None else images
        if kept:
            record["images"] = kept
        return record

    @classmethod
    def from_record(cls, r: Any, vocab_size: int) -> Session:
        """A session from a record read from disk, or ValueError saying what is wrong with it."""
        if not isinstance(r, dict):
            raise ValueError("the record is not an object")
        for name, kind in (
            ("id", str),
            ("owner", str),
            ("model", str),
            ("created_at", int),
            ("last_used", (int, float)),
            ("defaults", dict),
            ("messages", list),
        ):
            if not isinstance(r.get(name), kind) or isinstance(r.get(name), bool):
                raise ValueError(f"{name} is missing or not of type {kind}")
        if not SESSION_ID.match(r["id"]):
            raise ValueError(f"id {r['id']!r} is not a session id")
        for name in ("created_at", "last_used"):
            if not math.isfinite(r[name]) or not 0 <= r[name] < 2**53:
                raise ValueError(f"{name} is not a finite time")
        if not all(isinstance(k, str) for k in r["defaults"]):
            raise ValueError("defaults has keys that are not strings")
        response = r.get("response")
        items = RECORD_ITEMS.get(KINDS[r["id"][: len(SESSION_PREFIX)]])
        if (response is not None) != (items is not None):
            raise ValueError("a response or conversation record needs a response, a session none")
        if response is not None and not (
            isinstance(response, dict)
            and isinstance(response.get("object"), dict)
            and isinstance(response.get(items), list)
            and isinstance(response.get("chain"), str)
        ):
            raise ValueError(f"response must be an object with object, {items} and chain")
        messages = [_checked_message(m, vocab_size) for m in r["messages"]]
        return cls(
            id=r["id"],
            owner=r["owner"],
            model=r["model"],
            messages=messages,
            defaults=dict(r["defaults"]),
            created_at=r["created_at"],
            last_used=float(r["last_used"]),
            response=response,
            images=_checked_images(r.get("images", {}), messages),
        )


def _checked_message(m: Any, vocab_size: int) -> Message:
    if not isinstance(m, dict) or m.get("role") not in STORED_ROLES or not isinstance(m.get("content"), str):
        raise ValueError(f"message {m!r:.80} is not a {{role, content}} object")
    if not encodes_as_utf8(m["content"]):
        raise ValueError("a message content is not valid Unicode")
    message: Message = {"role": m["role"], "content": m["content"]}
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ValueError("a tool message needs its tool_call_id")
        message["tool_call_id"] = m["tool_call_id"]
    if "tool_calls" in m:
        message["tool_calls"] = _checked_tool_calls(m)
    if "images" in m:
        if m["role"] != "user" or not isinstance(m["images"], list) or not all(isinstance(k, str) for k in m["images"]):
            raise ValueError("images must be the image keys of a user message")
        message["images"] = list(m["images"])
    ids = m.get("token_ids")
    if ids is not None:
        if (
            m["role"] != "assistant"
            or not isinstance(ids, list)
            or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < min(vocab_size, INT32_MAX) for i in ids
            )
        ):
            raise ValueError("token_ids must be token ids of an assistant message")
        message["token_ids"] = ids
    return message


def _checked_images(images: Any, messages: list[Message]) -> dict[str, str]:
    """A session's image urls by key, each key one its messages name."""
    if not isinstance(images, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in images.items()):
        raise ValueError("images must map image keys to urls")
    missing = {k for m in messages for k in m.get("images", ())} - images.keys()
    if missing:
        raise ValueError(f"the messages name images it does not keep: {sorted(missing)[:3]}")
    return dict(images)


def _checked_tool_calls(m: dict[str, Any]) -> list[dict[str, Any]]:
    calls = m["tool_calls"]
    if (
        m["role"] != "assistant"
        or not isinstance(calls, list)
        or not all(
            isinstance(c, dict)
            and isinstance(c.get("id"), str)
            and c.get("type") == "function"
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), str)
            for c in calls
        )
    ):
        raise ValueError("tool_calls must be the function calls of an assistant message")
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        }
        for c in calls
    ]


class SessionStore:
    def __init__(
        self, max_per_owner: int, ttl: float, files: SessionFiles | None = None, response_ttl: float | None = None
    ) -> None:
        self.max_per_owner = max_per_owner
        self.ttl = ttl
        self.response_ttl = ttl if response_ttl is None else response_ttl  # idle seconds of a stored response
        self.files = files
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def load(self, vocab_size: int) -> int:
        """Read the sessions saved on disk (after a restart); returns how many. Bad records
        are quarantined, the others load."""
        if self.files is None:
            return 0
        for path, record in self.files.records():
            try:
                session = Session.from_record(record, vocab_size)
                if session.id != path.stem:
                    raise ValueError(f"the record's id {session.id} is not its file's name")
            except ValueError as e:
                self.files.quarantine(path, str(e))
                continue
            self._sessions[session.id] = session
        return len(self._sessions)

    def create(
        self,
        owner: str,
        model: str,
        messages: list[Message],
        defaults: dict[str, Any],
        response: dict[str, Any] | None = None,
        session_id: str | None = None,
        images: dict[str, str] | None = None,
    ) -> Session:
        """A new session (written first when there are files; `images`: the urls its messages'
        images keys name), or with `response` a stored response or conversation (of id
        `session_id`; `server.response_store` keeps their count per key)."""
        if response is None and len(self.owned_by(owner)) >= self.max_per_owner:
            raise APIError(
                429,
                f"this key already has {self.max_per_owner} sessions; delete some first",
                code="session_limit_reached",
            )
        session = Session(
            id=session_id or new_session_id(),
            owner=owner,
            model=model,
            messages=[dict(m) for m in messages],
            defaults=dict(defaults),
            response=response,
            images=dict(images or {}),
        )
        self._write(session.record())
        self._sessions[session.id] = session
        return session

    def get(self, owner: str, session_id: str) -> Session:
        """The owner's session (not a stored response), or 404."""
        session = self.find(owner, session_id, "session")
        if session is None:
            raise not_found(f"no session {session_id!r}", code="session_not_found")
        return session

    def find(self, owner: str, session_id: str, kind: str) -> Session | None:
        """The owner's session, stored response or conversation (`kind`) of that id; None if none."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner or session.kind != kind:
            return None
        return session

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def owned_by(self, owner: str, kind: str | None = "session") -> list[Session]:
        """The owner's sessions, stored responses or conversations (`kind`), or all (None), oldest first."""
        return sorted(
            (s for s in self._sessions.values() if s.owner == owner and (kind is None or s.kind == kind)),
            key=lambda s: s.created_at,
        )

    def contains(self, session: Session) -> bool:
        return self._sessions.get(session.id) is session

    def remove(self, session: Session) -> None:
        if self._sessions.get(session.id) is session:
            if self.files is not None:
                try:
                    self.files.delete(session.id)
                except OSError as e:
                    raise _write_failed(e) from None
            del self._sessions[session.id]

    def commit(
        self,
        session: Session,
        messages: list[Message],
        response: dict[str, Any] | None = None,
        images: dict[str, str] | None = None,
    ) -> None:
        """Make `messages` the session's history (and `response` a stored response's record,
        `images` the urls its messages' image keys name): on disk first, then in memory (APIError
        500, nothing changed, when the write fails). A session deleted meanwhile stays deleted."""
        now = time.time()
        if self.contains(session):
            self._write(session.record(messages, now, response, images))
        session.messages = messages
        session.last_used = now
        if response is not None:
            session.response = response
        if images is not None:
            session.images = images

    def save_all(self) -> None:
        """Write every session that is not replying as it is (at shutdown: last use times);
        failures are logged."""
        for session in self.all():
            if session.busy:
                continue
            try:
                self._write(session.record())
            except APIError:
                pass

    def _write(self, record: dict[str, Any]) -> None:
        if self.files is None:
            return
        try:
            self.files.save(record)
        except OSError as e:
            raise _write_failed(e) from None

    def expired(self, now: float | None = None) -> list[Session]:
        now = time.time() if now is None else now
        return [
            s
            for s in self._sessions.values()
            if not s.busy and now - s.last_used > (self.ttl if s.response is None else self.response_ttl)
        ]


def new_session_id(prefix: str = SESSION_PREFIX) -> str:
    return prefix + secrets.token_hex(12)
