"""`EngineClient` over worker processes: what `jaxserve router` gives the server.

The server (routes, sessions, keys, limits, metrics) cannot tell it from the one-process
engine: `generate` streams the same deltas, `abort` stops a request, `snapshot` sums the
workers', and session pins live in the cache of the worker holding the session.

Placement is the in-process data-parallel engine's (`jaxserve.placement.Placement`, SGLang's
defaults): the approximate prefix tree of each worker (fed with what the router sent it) against
the sequences the router has running there; a session's turns stay on their worker while it is
up (`worker_pool.py`). A request with n choices becomes n one-sequence worker requests on one
worker, with the seeds the engine would give its choices (a request without a seed gets one drawn
here, as the engine would draw it). A worker that fails before it streamed anything for a sequence gets the
sequence retried on another. One that fails after has it resumed on another: the new worker's
prompt is the prompt plus the tokens streamed so far (their KV recomputed there), its budget the
rest (`handover.decode_params`); the sampler keys a draw by its position in the whole sequence, so
greedy and seeded sequences go on as they would have, the client's stream goes on without a break
or a repeat, and usage counts the original prompt and every output token once. Sequences whose
sampling follows their output alone (presence or frequency penalties, a grammar) cannot resume and
end with an error (`WorkerLostError`, a 503 event on a started stream), as does a sequence when no
worker is left to take it (a worker that failed it is tried again only once it has restarted).
Running a choice to its end, with its retries and resumes, is `sequence_runner.py`.

With prefill workers (`prefill_workers`), a request that `handover.splits` is prefilled on one
of them (placed by the same policy over their own prefix trees), which streams the first token
and leases the prompt's KV blocks; the decode worker placed as above pulls the blocks, admits the
rest of the request and streams it to the end. A prefill worker that fails before its token came
leaves the request to a decode worker alone; so does a router without a prefill worker up. A
decode worker that fails before it streamed a token of its half gets the half retried on another
decode worker, with the same KV source (pulled while the lease holds, else recomputed); one that
fails after has the sequence resumed on another decode worker, as above.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from jaxserve.engine_client import (
    DuplicateRequestError,
    EngineDeadError,
    EngineInfo,
    Pin,
    encode_prompt,
    merge_choices,
)
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.image_prompt import MultimodalPrompt
from jaxserve.outputs import Delta
from jaxserve.placement import PlacementPolicy
from jaxserve.sampling_params import SamplingParams
from server.cluster.router.sequence_runner import Choice, Placed, SequenceRunner
from server.cluster.router.worker_calls import CALL_TIMEOUT
from server.cluster.router.worker_client import RemotePin, WorkerClient, engine_info
from server.cluster.router.worker_pool import WorkerPool
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import cache_ids_of, images_to_messages, snapshot_from_json
from server.tls import ClusterTLS

logger = logging.getLogger(__name__)


class RemoteEngine:
    """`EngineClient` over worker processes (placement, retries, disaggregation, pins by id)."""

    def __init__(
        self,
        workers: Sequence[WorkerClient],
        policy: PlacementPolicy | None = None,
        health_interval: float = 1.0,
        prefill_workers: Sequence[WorkerClient] = (),
    ) -> None:
        self.pool = WorkerPool(workers, policy or PlacementPolicy(), prefill_workers)
        self.runs = SequenceRunner(self.pool)
        self.health_interval = health_interval
        self.info: EngineInfo | None = None  # set by `connect`
        self.fatal_error: BaseException | None = None  # a router never dies of a worker
        self.on_step = None  # no engine loop runs here
        self._requests: dict[str, list[Placed]] = {}
        self._health_task: asyncio.Task | None = None

    @classmethod
    async def connect(
        cls,
        addresses: Sequence[str],
        policy: PlacementPolicy | None = None,
        health_interval: float = 1.0,
        timeout: float = 300.0,
        decode_addresses: Sequence[str] = (),
        prefill_addresses: Sequence[str] = (),
        tls: ClusterTLS | None = None,
    ) -> RemoteEngine:
        """Wait (up to `timeout` s) until a worker that generates serves, then keep checking them
        all. `addresses` are colocated workers (--role both), `decode_addresses` decode workers;
        until a prefill worker is up, decode workers run requests whole. `tls`: mutual TLS to every worker."""
        workers = [WorkerClient(a, tls=tls) for a in addresses]
        workers += [WorkerClient(a, ("decode", "both"), tls) for a in decode_addresses]
        prefill = [WorkerClient(a, ("prefill", "both"), tls) for a in prefill_addresses]
        remote = cls(workers, policy, health_interval, prefill)
        pool = remote.pool
        deadline = time.monotonic() + timeout
        while True:
            await pool.check()
            if remote.is_alive:
                break
            if time.monotonic() > deadline:
                details = "; ".join(f"{w.address}: {w.detail}" for w in pool.workers)
                raise ConnectionError(f"no worker served within {timeout:g} s ({details})")
            await asyncio.sleep(min(0.5, health_interval))
        remote.info = engine_info(pool.reference, len(pool.workers))
        remote._health_task = asyncio.create_task(pool.health_loop(health_interval))
        return remote

    @property
    def workers(self) -> list[WorkerClient]:
        return self.pool.workers

    @property
    def prefill_workers(self) -> list[WorkerClient]:
        return self.pool.prefill_workers

    # ----- EngineClient ---------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        """Some worker serves."""
        return any(w.up for w in self.pool.workers)

    @property
    def last_step_at(self) -> float:
        return time.monotonic()  # no loop of its own that could be stuck; workers report theirs

    def running_capacity(self) -> int:
        """The running slots of the generating workers that are up, as each reported them (`Info`)."""
        return sum(w.info.max_num_seqs for w in self.pool.workers if w.up and w.info is not None)

    def health_details(self) -> dict[str, object]:
        details: dict[str, object] = {"workers": [w.status() for w in self.pool.workers]}
        if self.pool.prefill_workers:
            details["prefill_workers"] = [w.status() for w in self.pool.prefill_workers]
        return details

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams,
        session_id: str | None = None,
        hold_kv: bool = False,
    ) -> AsyncIterator[Delta]:
        """See `EngineClient.generate`: on the worker that placement picks (retried elsewhere when
        it fails before streaming), a prompt's images sent with it (placed by its ids with the
        images' rows salted by their digests, as the workers' caches key them). A router holds no KV
        of its own (`hold_kv` is refused)."""
        if hold_kv:
            raise ValueError("a router holds no KV blocks (hold_kv is a worker's)")
        if params.prompt_logprobs is not None:  # the worker protocol carries no prompt scores yet
            raise ValueError("prompt_logprobs (and echo with logprobs) are not served through the router yet")
        info = self.info
        ids = encode_prompt(prompt, info.tokenizer, info.vocab_size, info.max_model_len)
        params.check_vocabulary(self.info.vocab_size)
        images = tuple(images_to_messages(prompt.images)) if isinstance(prompt, MultimodalPrompt) else ()
        if images and info.vision is None:
            raise ValueError("this model takes no images (it has no vision tower)")
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        worker = self.pool.place(cache_ids_of(ids, images), session_id, params.lora)
        # Each choice counts in its worker's load from now to its end: the next request of a
        # burst, placed before this one's worker calls start, sees it.
        worker.in_flight += params.n
        # The engine's seeds: consecutive from the request's (or a drawn) seed, fixed here so that
        # a sequence resumed on another worker keeps its random stream.
        base = params.seed if params.seed is not None else random.getrandbits(31)
        out: asyncio.Queue = asyncio.Queue()
        choices = [
            Choice(
                request_id,
                i,
                Placed(request_id if params.n == 1 else f"{request_id}-{i}", worker),
                ids,
                params,
                (base + i) % (1 << 31),
                session_id,
                out,
                self.info.tokenizer,
                self.info.max_model_len,
                images,
            )
            for i in range(params.n)
        ]
        self._requests[request_id] = [c.placed for c in choices]
        tasks = [asyncio.create_task(self.runs.run(c)) for c in choices]
        try:
            async for item in merge_choices(out, params.n):
                yield item
        finally:  # cancelling a worker call aborts its request there
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for choice in choices:
                choice.placed.worker.in_flight -= 1
            del self._requests[request_id]

    def abort(self, request_id: str) -> None:
        """Stop a request on its workers; its streams end with finish_reason "abort"."""
        for placed in self._requests.get(request_id, ()):
            for worker in {placed.worker, placed.prefill} - {None}:
                self.pool.spawn(worker.stub.Abort(pb.AbortRequest(request_id=placed.request_id), timeout=CALL_TIMEOUT))

    async def snapshot(self) -> EngineSnapshot | None:
        """The workers' snapshots summed (those that answer), with the KV transfers counted
        here; None when none answers."""
        up = [w for w in self.pool.everyone if w.up]
        replies = await asyncio.gather(
            *(w.stub.Load(pb.LoadRequest(), timeout=CALL_TIMEOUT) for w in up), return_exceptions=True
        )
        snapshots = [snapshot_from_json(r.snapshot_json) for r in replies if isinstance(r, pb.LoadResponse)]
        if not snapshots:
            return None
        return dataclasses.replace(EngineSnapshot.total(snapshots), kv_transfer=self.runs.transfers)

    async def pin_history(
        self,
        session_id: str,
        owner: str,
        token_ids: list[int],
        old: Pin | None,
        others: list[Pin],
        lora: str | None = None,
    ) -> tuple[Pin | None, list[Pin]] | None:
        """`EngineClient.pin_history` in the cache of the session's worker (None if unreachable)."""
        try:
            worker = self.pool.place(token_ids, session_id, lora)
        except EngineDeadError:
            return None
        mine = [p for p in (*others, old) if isinstance(p, RemotePin) and p.on(worker)]
        salted = any(t < 0 for t in token_ids)  # (a history holding images: their rows salted)
        request = pb.PinHistoryRequest(
            session_id=session_id,
            owner=owner,
            token_ids=() if salted else token_ids,
            cache_token_ids=token_ids if salted else (),
            old_pin=old.remote_id if old in mine else 0,
            others=[p.remote_id for p in others if p in mine],
            lora=lora or "",
        )
        try:
            reply = await worker.stub.PinHistory(request, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            logger.warning("pinning a session on %s failed: %s", worker.address, e.code().name)
            return None
        by_id = {p.remote_id: p for p in mine}
        released = [by_id[i] for i in reply.released if i in by_id]
        for p in released:
            p.active = False
        if old in mine and reply.pin:
            old.active = False  # replaced by the new pin
        if not reply.pin:
            return None, released
        pin = RemotePin(
            owner,
            reply.num_blocks,
            reply.num_tokens,
            worker=worker,
            instance_id=worker.instance_id,
            remote_id=reply.pin,
        )
        return pin, released

    async def unpin(self, pin: Pin) -> None:
        if isinstance(pin, RemotePin) and pin.worker is not None and pin.on(pin.worker):
            pin.active = False
            unpin = pin.worker.stub.Unpin(pb.UnpinRequest(pin=pin.remote_id), timeout=CALL_TIMEOUT)
            await self.pool.quietly(pin.worker, unpin)

    async def end_sessions(self, ended: list[tuple[str, Pin | None]]) -> None:
        """Sessions that are gone: forget their workers and release their pins there."""
        per_worker: dict[WorkerClient, list[pb.EndedSession]] = {}
        for session_id, pin in ended:
            worker = self.pool.placement.end_session(session_id)
            if isinstance(pin, RemotePin) and pin.worker is not None and pin.on(pin.worker):
                pin.active = False
                per_worker.setdefault(pin.worker, []).append(pb.EndedSession(session_id=session_id, pin=pin.remote_id))
            elif worker is not None:
                per_worker.setdefault(worker, []).append(pb.EndedSession(session_id=session_id))
        await asyncio.gather(
            *(
                self.pool.quietly(w, w.stub.EndSessions(pb.EndSessionsRequest(sessions=s), timeout=CALL_TIMEOUT))
                for w, s in per_worker.items()
                if w.up
            )
        )

    async def set_pin_budget(self, blocks_per_owner: int) -> None:
        """Every worker's budget, now and whenever a worker (re)joins."""
        self.pool.pin_budget = blocks_per_owner
        await asyncio.gather(*(self.pool.send_pin_budget(w) for w in self.pool.workers if w.up))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the adapter on every worker that serves (each reads `path` on its own file
        system), and later on every worker that joins or restarts."""
        up = await self.pool.on_every_worker(
            lambda w: w.stub.LoadLoraAdapter(pb.LoraAdapterRequest(name=name, path=path), timeout=CALL_TIMEOUT)
        )
        self.pool.adapters[name] = path
        for worker in self.pool.workers:
            worker.sent.forget_adapter(name)  # the name's earlier weights' KV is not these
        for worker in up:
            worker.loaded_adapters.add(name)

    async def unload_lora_adapter(self, name: str) -> None:
        self.pool.adapters.pop(name, None)
        for worker in self.pool.workers:
            worker.loaded_adapters.discard(name)
            worker.sent.forget_adapter(name)  # a name loaded again later may be other weights
            worker.sent.recent_adapters.pop(name, None)
        await self.pool.on_every_worker(
            lambda w: w.stub.UnloadLoraAdapter(pb.LoraAdapterRequest(name=name), timeout=CALL_TIMEOUT)
        )

    async def lora_adapters(self) -> dict[str, str] | None:
        """The adapters the workers serve (every one loads the same; the first that answers says)."""
        for worker in self.pool.workers:
            if not worker.up:
                continue
            try:
                reply = await worker.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                logger.warning("listing the LoRA adapters of worker %s failed: %s", worker.address, e.code().name)
                continue
            worker.note_adapters(reply)
            return dict(reply.adapters)
        return None

    async def aclose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self.pool.close()
