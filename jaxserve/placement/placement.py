"""The one placement of requests on targets: sessions stick to their target, other requests go
where `PlacementPolicy` says (prefix-aware, load-aware, LoRA slots).

The in-process data-parallel engine places on its replicas, which answer from their own prefix
caches; the router places on worker processes, which answer from the picture the router keeps of
what it sent them (`SentPrefixes`). Both are `PlacementTarget`s.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from jaxserve.placement.policy import PlacementPolicy, choose_target


class PlacementTarget(Protocol):
    """What placement asks of a target."""

    @property
    def load(self) -> int:
        """Unfinished sequences the target holds."""
        ...

    def prefix_match_length(self, token_ids: Sequence[int], lora: str | None = None) -> int:
        """Tokens of `token_ids` from the start the target has cached (for adapter `lora`: that
        adapter's KV only; 0 when the target cannot serve the adapter)."""
        ...

    def adapter_resident(self, name: str) -> bool:
        """The target holds adapter `name` in a LoRA slot (a request of it waits for none)."""
        ...


T = TypeVar("T", bound=PlacementTarget)


class Placement(Generic[T]):
    """Which target a request goes to, and which target each session is on."""

    def __init__(self, targets: Sequence[T], policy: PlacementPolicy) -> None:
        if not targets:
            raise ValueError("placement needs at least one engine replica or worker")
        self.targets = list(targets)
        self.policy = policy
        self._sessions: dict[Hashable, T] = {}

    def loads(self) -> list[int]:
        return [t.load for t in self.targets]

    def choose(
        self,
        token_ids: Sequence[int],
        session_id: Hashable | None = None,
        lora: str | None = None,
        candidates: Sequence[T] | None = None,
    ) -> T:
        """The target a prompt goes to now, among `candidates` (default: every target): its
        session's when that is a candidate, else by the policy. Records nothing (see `stick`)."""
        candidates = self.targets if candidates is None else candidates
        if session_id is not None:
            target = self._sessions.get(session_id)
            if target is not None and target in candidates:
                return target
        if len(candidates) == 1:
            return candidates[0]
        matches = [t.prefix_match_length(token_ids, lora) for t in candidates]
        resident = None if lora is None else [t.adapter_resident(lora) for t in candidates]
        loads = [t.load for t in candidates]
        return candidates[choose_target(matches, loads, len(token_ids), self.policy, resident)]

    def place(
        self,
        token_ids: Sequence[int],
        session_id: Hashable | None = None,
        lora: str | None = None,
        candidates: Sequence[T] | None = None,
    ) -> T:
        """`choose`, and the session (if any) sticks to the chosen target."""
        target = self.choose(token_ids, session_id, lora, candidates)
        self.stick(session_id, target)
        return target

    def stick(self, session_id: Hashable | None, target: T) -> None:
        """The session's later requests go to `target` (its KV is there now)."""
        if session_id is not None:
            self._sessions[session_id] = target

    def session_target(self, session_id: Hashable) -> T | None:
        return self._sessions.get(session_id)

    def end_session(self, session_id: Hashable) -> T | None:
        """Forget a session's target (returned): its next request is placed afresh."""
        return self._sessions.pop(session_id, None)

    def forget_target(self, target: T) -> None:
        """The target lost its cache (it restarted): its sessions are placed afresh."""
        for session_id in [s for s, t in self._sessions.items() if t is target]:
            del self._sessions[session_id]
