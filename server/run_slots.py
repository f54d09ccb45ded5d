"""The server's own queue in front of the engine, with a deadline (`--max-queue-wait`).

The engine runs at most `max_num_seqs` sequences at once (a router: the sum of its workers' that
are up, `capacity`, read again as the queue is served and every GRANT_POLL seconds while requests
wait, so the slots of a worker that comes back are used). With a queue deadline, the server hands
the engine only that many: each admitted request takes running slots for its sequences before it
reaches the engine, or waits here for them, in priority order (the request's `priority`, lower
first, as vLLM orders it) and then arrival order. A request still waiting after `max_wait` seconds
is refused with 503 and Retry-After instead of running late: it never reached the engine, so it
holds no KV. Slots are never granted past a ticket's deadline (a late timer cannot let one
through). A large request at the head of the queue is not overtaken by smaller ones behind it (no
starvation).

Without a deadline the server does not queue: requests go to the engine, which queues them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable

from server.errors import APIError

GRANT_POLL = 0.5  # seconds between looks at the engine's capacity while requests wait


class Ticket:
    """One request's claim on `seqs` running slots: granted at once, or waiting in the queue."""

    def __init__(self, seqs: int, priority: int, order: int, max_wait: float) -> None:
        loop = asyncio.get_running_loop()
        self.seqs = seqs
        self.priority = priority
        self.order = order
        self.granted: asyncio.Future[None] = loop.create_future()
        self.queued_at = loop.time()
        self.deadline = self.queued_at + max_wait
        self.waited = 0.0  # seconds from the request's arrival in the queue to its slots
        self.holding = False  # granted and not yet released

    def __lt__(self, other: Ticket) -> bool:
        return (self.priority, self.order) < (other.priority, other.order)


class RunSlots:
    """`slots`: the most the engine ever runs at once; `capacity`: what it runs now (default: `slots`)."""

    def __init__(self, slots: int, max_wait: float, capacity: Callable[[], int] | None = None) -> None:
        if slots < 1 or max_wait <= 0:
            raise ValueError("RunSlots needs slots >= 1 and max_wait > 0")
        self.slots = slots
        self.capacity = capacity or (lambda: slots)
        self.max_wait = max_wait
        self.used = 0  # slots held by requests handed to the engine
        self._queue: list[Ticket] = []  # a heap: the next request to run first
        self._order = itertools.count()

    @property
    def waiting_seqs(self) -> int:
        """Sequences waiting in the queue for running slots."""
        return sum(t.seqs for t in self._queue)

    @property
    def waiting_requests(self) -> int:
        return len(self._queue)

    def take(self, seqs: int, priority: int) -> Ticket:
        """A ticket for `seqs` slots: granted now when they are free and nobody waits, else queued.
        A request with more sequences than there are slots claims them all (the engine runs its
        sequences a part at a time)."""
        ticket = Ticket(min(seqs, self.slots), priority, next(self._order), self.max_wait)
        heapq.heappush(self._queue, ticket)
        self._grant()
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Until `ticket` is granted; APIError 503 (and out of the queue) after `max_wait` seconds.
        Cancelled while waiting (the client went away), it leaves the queue too."""
        try:
            await self._wait_granted(ticket)
        except TimeoutError:
            if self._leave(ticket):
                raise self._timed_out() from None
            ticket.granted.result()  # decided as the timer fired: granted (returns) or refused (raises)
        except asyncio.CancelledError:
            self._leave(ticket)
            raise

    async def _wait_granted(self, ticket: Ticket) -> None:
        """Until `ticket` is granted, granting what the capacity allows every GRANT_POLL seconds (a worker
        that came back); TimeoutError at its deadline."""
        loop = asyncio.get_running_loop()
        while not ticket.granted.done():
            left = ticket.deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(asyncio.shield(ticket.granted), min(left, GRANT_POLL))
            except TimeoutError:
                self._grant()
        ticket.granted.result()

    def withdraw(self, ticket: Ticket, error: APIError | None) -> None:
        """End a waiting ticket's wait without slots: with `error` raised (the server is stopping),
        or none (the request was cancelled, and ends without running); no-op once granted."""
        if not self._leave(ticket):
            return
        if error is None:
            ticket.granted.set_result(None)
        else:
            ticket.granted.set_exception(error)

    def release(self, ticket: Ticket) -> None:
        """Give back a granted ticket's slots (the request has left the engine), or its place in
        the queue."""
        if ticket.holding:
            ticket.holding = False
            self.used -= ticket.seqs
            self._grant()
        else:
            self._leave(ticket)

    def _leave(self, ticket: Ticket) -> bool:
        """Take a waiting `ticket` out of the queue; False when it was not waiting (granted)."""
        if ticket not in self._queue:
            return False
        self._queue.remove(ticket)
        heapq.heapify(self._queue)
        self._grant()  # the ones behind it may fit now
        return True

    def _grant(self) -> None:
        now = asyncio.get_running_loop().time()
        capacity = self.capacity()
        while self._queue and self.used + self._queue[0].seqs <= capacity:
            ticket = heapq.heappop(self._queue)
            if now > ticket.deadline:  # its timer is late (a busy loop): refused all the same
                ticket.granted.set_exception(self._timed_out())
                continue
            self.used += ticket.seqs
            ticket.holding = True
            ticket.waited = now - ticket.queued_at
            ticket.granted.set_result(None)

    def _timed_out(self) -> APIError:
        return APIError(
            503,
            f"the server is overloaded: the request waited {self.max_wait:g} s in the queue without "
            "starting; retry later",
            code="queue_timeout",
            headers={"Retry-After": str(max(1, math.ceil(self.max_wait)))},
        )
