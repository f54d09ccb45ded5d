"""A bounded waiting queue: refuse work (503) instead of queueing it without end.

The engine runs up to `max_num_seqs` sequences at once; every admitted sequence beyond that
waits in its queue. The server counts the sequences it has handed to the engine and not yet
seen finish, and refuses a request whose sequences would push the waiting part past the bound.
A request with more sequences (n x prompts) than the whole bound could never pass, however long
the client retried: that is a 400 naming the limit, not a 503. (Each sequence's own length is
bounded by the context, which the engine already keeps within its KV capacity.)

With a queue deadline (`max_queue_wait`), admitted sequences past the running ones wait in the
server's own queue (`server.run_slots`), each at most that long.

The running part is the engine's capacity now (`running_capacity`, `EngineClient.running_capacity`):
a router's is the sum of the workers that are up, so with a worker down it admits that much less
and refuses the rest at once rather than queueing work for capacity that is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from server.errors import APIError
from server.run_slots import RunSlots


class Admission:
    """`max_running_seqs`: the most the engine ever runs at once (a router: all its workers');
    `running_capacity`: what it can run now (default: always the most)."""

    def __init__(
        self,
        max_running_seqs: int,
        max_waiting_seqs: int,
        max_queue_wait: float = 0.0,
        running_capacity: Callable[[], int] | None = None,
    ) -> None:
        self.max_waiting = max_waiting_seqs
        self.max_capacity = max_running_seqs + max_waiting_seqs  # a larger request never fits: 400
        self.running_capacity = running_capacity or (lambda: max_running_seqs)
        self.in_flight = 0
        self.slots = RunSlots(max_running_seqs, max_queue_wait, self.running_capacity) if max_queue_wait > 0 else None

    @property
    def capacity(self) -> int:
        """Sequences it admits at once now: the running capacity now plus the waiting bound."""
        return self.running_capacity() + self.max_waiting

    def queue_depth(self) -> int:
        """Admitted sequences waiting for a running slot: in the server's queue when it has one,
        else those admitted past the running slots (they wait in the engine's queue)."""
        if self.slots is not None:
            return self.slots.waiting_seqs
        return max(0, self.in_flight - self.running_capacity())

    @contextlib.contextmanager
    def hold(self, num_seqs: int) -> Iterator[None]:
        """Count `num_seqs` sequences while the block runs, or raise APIError 503 when full
        (400 when they would not fit even into an idle server)."""
        if num_seqs > self.max_capacity:
            raise APIError(
                400,
                f"the request asks for {num_seqs} sequences (n times the number of prompts); this server holds "
                f"at most {self.max_capacity} at once",
                param="n",
                code="request_too_large",
            )
        if self.in_flight + num_seqs > self.capacity:
            raise APIError(
                503,
                "the server is overloaded: its waiting queue is full; retry later",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            )
        self.in_flight += num_seqs
        try:
            yield
        finally:
            self.in_flight -= num_seqs
