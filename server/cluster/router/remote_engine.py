"""`EngineClient` over worker processes: what `jaxserve router` gives the server.

The server (routes, sessions, keys, limits, metrics) cannot tell it from the one-process
engine: `generate` streams the same deltas, `abort` stops a request, `snapshot` sums the
workers', and session pins live in the cache of the worker holding the session.

Placement follows the in-process data-parallel router (`choose_replica`, the same policy):
the approximate prefix tree of each worker (fed with what the router sent it) against the
sequences the router has running there; a session's turns stay on their worker while it is
up. A request with n choices becomes n one-sequence worker requests on one worker, with the
seeds the engine would give its choices (a request without a seed gets one drawn here, as the
engine would draw it). A worker that fails before it streamed anything for a sequence gets the
sequence retried on another. One that fails after has it resumed on another: the new worker's
prompt is the prompt plus the tokens streamed so far (their KV recomputed there), its budget the
rest (`handover.decode_params`); the sampler keys a draw by its position in the whole sequence, so
greedy and seeded sequences go on as they would have, the client's stream goes on without a break
or a repeat, and usage counts the original prompt and every output token once. Sequences whose
sampling follows their output alone (presence or frequency penalties, a grammar) cannot resume and
end with an error (`WorkerLostError`, a 503 event on a started stream), as does a sequence when no
worker is left to take it (a worker that failed it is tried again only once it has restarted).

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from jaxserve.engine_client import (
    EngineDeadError,
    EngineInfo,
    Pin,
    RequestFailedError,
    UnknownAdapterError,
    check_prompt_ids,
)
from jaxserve.engine_snapshot import EngineSnapshot, KVTransferStats
from jaxserve.outputs import Delta, Usage
from jaxserve.routing import RoutingPolicy, adapter_key, choose_replica
from jaxserve.sampling_params import SamplingParams, encodes_as_utf8
from server.cluster.router.handover import decode_params, prefill_params, resumes, splits
from server.cluster.router.sequence import RemoteSequence, worker_params
from server.cluster.router.worker_calls import CALL_TIMEOUT, prefill_once, stream_once, with_transfer
from server.cluster.router.worker_client import RemotePin, RoutedAdapter, WorkerClient, WorkerInfo, engine_info
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import params_to_json, snapshot_from_json, usage_from_message

logger = logging.getLogger(__name__)

# SGLang's router defaults: a cached prefix counts from 30% of the prompt; route by load alone
# when the busiest worker runs more than 64 sequences over the idlest and 1.5x its load.
ROUTER_POLICY = RoutingPolicy(match_fraction=0.3, balance_abs=64, balance_rel=1.5)


class WorkerLostError(EngineDeadError):
    """The worker generating a sequence failed after part of it was streamed."""


@dataclasses.dataclass
class _Placed:
    """One worker request of a call: a choice, and the worker generating it."""

    request_id: str
    worker: WorkerClient
    prefill: WorkerClient | None = None  # prefilling it (disaggregation)


class RemoteEngine:
    """`EngineClient` over worker processes (placement, retries, disaggregation, pins by id)."""

    def __init__(
        self,
        workers: Sequence[WorkerClient],
        policy: RoutingPolicy = ROUTER_POLICY,
        health_interval: float = 1.0,
        prefill_workers: Sequence[WorkerClient] = (),
    ) -> None:
        if not workers:
            raise ValueError("a router needs at least one worker")
        self.workers = list(workers)  # colocated or decode workers: they generate to the end
        self.prefill_workers = list(prefill_workers)
        self.transfers = KVTransferStats()
        self.policy = policy
        self.health_interval = health_interval
        self.info: EngineInfo | None = None  # set by `connect`
        self.fatal_error: BaseException | None = None  # a router never dies of a worker
        self.on_step = None  # no engine loop runs here
        self._reference: WorkerInfo | None = None
        self._requests: dict[str, list[_Placed]] = {}
        self._sessions: dict[str, WorkerClient] = {}
        self._pin_budget: int | None = None
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._adapters: dict[str, str] = {}  # LoRA adapters loaded through the router: name -> directory
        self._adapter_numbers: dict[str, int] = {}  # the prefix trees' key of each adapter name

    @classmethod
    async def connect(
        cls,
        addresses: Sequence[str],
        policy: RoutingPolicy = ROUTER_POLICY,
        health_interval: float = 1.0,
        timeout: float = 300.0,
        decode_addresses: Sequence[str] = (),
        prefill_addresses: Sequence[str] = (),
    ) -> RemoteEngine:
        """Wait (up to `timeout` s) until a worker that generates serves, then keep checking them
        all. `addresses` are colocated workers (--role both), `decode_addresses` decode workers;
        until a prefill worker is up, decode workers run requests whole."""
        workers = [WorkerClient(a) for a in addresses] + [WorkerClient(a, ("decode", "both")) for a in decode_addresses]
        prefill = [WorkerClient(a, ("prefill", "both")) for a in prefill_addresses]
        remote = cls(workers, policy, health_interval, prefill)
        deadline = time.monotonic() + timeout
        while True:
            await remote.check_workers()
            if remote.is_alive:
                break
            if time.monotonic() > deadline:
                details = "; ".join(f"{w.address}: {w.detail}" for w in remote.workers)
                raise ConnectionError(f"no worker served within {timeout:g} s ({details})")
            await asyncio.sleep(min(0.5, health_interval))
        remote.info = engine_info(remote._reference, len(remote.workers))
        remote._health_task = asyncio.create_task(remote._health_loop())
        return remote

    # ----- EngineClient ---------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        """Some worker serves."""
        return any(w.up for w in self.workers)

    @property
    def last_step_at(self) -> float:
        return time.monotonic()  # no loop of its own that could be stuck; workers report theirs

    def health_details(self) -> dict[str, object]:
        details: dict[str, object] = {"workers": [w.status() for w in self.workers]}
        if self.prefill_workers:
            details["prefill_workers"] = [w.status() for w in self.prefill_workers]
        return details

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        session_id: str | None = None,
        hold_kv: bool = False,
    ) -> AsyncIterator[Delta]:
        """See `EngineClient.generate`: on the worker that routing picks (retried elsewhere when
        it fails before streaming). A router holds no KV of its own (`hold_kv` is refused)."""
        if hold_kv:
            raise ValueError("a router holds no KV blocks (hold_kv is a worker's)")
        if params.prompt_logprobs is not None:  # the worker protocol carries no prompt scores yet
            raise ValueError("prompt_logprobs (and echo with logprobs) are not served through the router yet")
        ids = self._prompt_ids(prompt)
        params.check_vocabulary(self.info.vocab_size)
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        worker = self._place(ids, session_id, params.lora)
        # The engine's seeds: consecutive from the request's (or a drawn) seed, fixed here so that
        # a sequence resumed on another worker keeps its random stream.
        base = params.seed if params.seed is not None else random.getrandbits(31)
        seeds = [base] if params.n == 1 else [(base + i) % (1 << 31) for i in range(params.n)]
        placed = [_Placed(request_id if params.n == 1 else f"{request_id}-{i}", worker) for i in range(params.n)]
        self._requests[request_id] = placed
        out: asyncio.Queue = asyncio.Queue()
        run = self._run_split if self.prefill_workers and splits(params) else self._run
        tasks = [
            asyncio.create_task(run(request_id, i, p, ids, params, seeds[i], session_id, out))
            for i, p in enumerate(placed)
        ]
        remaining = params.n
        try:
            while remaining:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:  # cancelling a worker call aborts its request there
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            del self._requests[request_id]

    def abort(self, request_id: str) -> None:
        """Stop a request on its workers; its streams end with finish_reason "abort"."""
        for placed in self._requests.get(request_id, ()):
            for worker in {placed.worker, placed.prefill} - {None}:
                self._spawn(worker.stub.Abort(pb.AbortRequest(request_id=placed.request_id), timeout=CALL_TIMEOUT))

    async def snapshot(self) -> EngineSnapshot | None:
        """The workers' snapshots summed (those that answer), with the KV transfers counted
        here; None when none answers."""
        up = [w for w in self.workers + self.prefill_workers if w.up]
        replies = await asyncio.gather(
            *(w.stub.Load(pb.LoadRequest(), timeout=CALL_TIMEOUT) for w in up), return_exceptions=True
        )
        snapshots = [snapshot_from_json(r.snapshot_json) for r in replies if isinstance(r, pb.LoadResponse)]
        if not snapshots:
            return None
        return dataclasses.replace(EngineSnapshot.total(snapshots), kv_transfer=self.transfers)

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
            worker = self._place(token_ids, session_id, lora)
        except EngineDeadError:
            return None
        mine = [p for p in (*others, old) if isinstance(p, RemotePin) and p.on(worker)]
        request = pb.PinHistoryRequest(
            session_id=session_id,
            owner=owner,
            token_ids=token_ids,
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
        pin = None
        if reply.pin:
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
            await self._quietly(
                pin.worker, pin.worker.stub.Unpin(pb.UnpinRequest(pin=pin.remote_id), timeout=CALL_TIMEOUT)
            )

    async def end_sessions(self, ended: list[tuple[str, Pin | None]]) -> None:
        """Sessions that are gone: forget their workers and release their pins there."""
        per_worker: dict[WorkerClient, list[pb.EndedSession]] = {}
        for session_id, pin in ended:
            worker = self._sessions.pop(session_id, None)
            if isinstance(pin, RemotePin) and pin.worker is not None and pin.on(pin.worker):
                pin.active = False
                per_worker.setdefault(pin.worker, []).append(pb.EndedSession(session_id=session_id, pin=pin.remote_id))
            elif worker is not None:
                per_worker.setdefault(worker, []).append(pb.EndedSession(session_id=session_id))
        await asyncio.gather(
            *(
                self._quietly(w, w.stub.EndSessions(pb.EndSessionsRequest(sessions=s), timeout=CALL_TIMEOUT))
                for w, s in per_worker.items()
                if w.up
            )
        )

    async def set_pin_budget(self, blocks_per_owner: int) -> None:
        """Every worker's budget, now and whenever a worker (re)joins."""
        self._pin_budget = blocks_per_owner
        await asyncio.gather(*(self._send_pin_budget(w) for w in self.workers if w.up))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the adapter on every worker that serves (each reads `path` on its own file
        system), and later on every worker that joins or restarts."""
        up = await self._on_every_worker(
            lambda w: w.stub.LoadLoraAdapter(pb.LoraAdapterRequest(name=name, path=path), timeout=CALL_TIMEOUT)
        )
        self._adapters[name] = path
        self._new_adapter_number(name)
        for worker in up:
            worker.loaded_adapters.add(name)

    async def unload_lora_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)
        for worker in self.workers:
            worker.loaded_adapters.discard(name)
            worker.recent_adapters.pop(name, None)
        self._new_adapter_number(name)  # a name loaded again later may be other weights
        await self._on_every_worker(
            lambda w: w.stub.UnloadLoraAdapter(pb.LoraAdapterRequest(name=name), timeout=CALL_TIMEOUT)
        )

    def _new_adapter_number(self, name: str) -> None:
        """A fresh prefix-tree key for `name`: nothing routed under an earlier one matches it."""
        self._adapter_numbers[name] = max(self._adapter_numbers.values(), default=0) + 1

    def _routed_adapter(self, name: str | None) -> RoutedAdapter | None:
        if name is None:
            return None
        if name not in self._adapter_numbers:
            self._new_adapter_number(name)
        return RoutedAdapter(name, self._adapter_numbers[name])

    async def lora_adapters(self) -> dict[str, str] | None:
        """The adapters the workers serve (every one loads the same; the first that answers says)."""
        for worker in self.workers:
            if worker.up:
                try:
                    return dict(
                        (
                            await worker.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=CALL_TIMEOUT)
                        ).adapters
                    )
                except grpc.aio.AioRpcError as e:
                    logger.warning("listing the LoRA adapters of worker %s failed: %s", worker.address, e.code().name)
        return None

    async def _on_every_worker(
        self, call: Callable[[WorkerClient], Awaitable[pb.LoraAdaptersResponse]]
    ) -> list[WorkerClient]:
        """A LoRA call on every worker that serves (returned): ValueError (a bad adapter) or
        UnknownAdapterError (an unknown name) as the first worker that refuses says."""
        up = [w for w in self.workers if w.up]
        if not up:
            raise EngineDeadError("no worker serves")
        results = await asyncio.gather(*(call(w) for w in up), return_exceptions=True)
        for worker, result in zip(up, results):
            if isinstance(result, grpc.aio.AioRpcError):
                if result.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(result.details())
                if result.code() == grpc.StatusCode.NOT_FOUND:
                    raise UnknownAdapterError(result.details())
                raise EngineDeadError(f"worker {worker.address}: {result.code().name}: {result.details()}")
            if isinstance(result, BaseException):
                raise result
        return up

    async def aclose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for worker in self.workers + self.prefill_workers:
            await worker.close()

    # ----- placement -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """As `LLMEngine.encode_prompt`: text gets what the tokenizer adds; ValueError when bad."""
        info = self.info
        if isinstance(prompt, str):
            if not encodes_as_utf8(prompt):
                raise ValueError("the prompt must be valid Unicode (no lone surrogates)")
            prompt = info.tokenizer.encode(prompt, add_special_tokens=True)
        return check_prompt_ids(prompt, info.vocab_size, info.max_model_len)

    def _place(self, ids: list[int], session_id: str | None, lora: str | None = None) -> WorkerClient:
        """The worker for a prompt: its session's while that worker is up, else by the policy."""
        if session_id is not None:
            worker = self._sessions.get(session_id)
            if worker is not None and worker.up:
                return worker
        worker = self._pick(ids, exclude=(), lora=lora)
        if session_id is not None:
            self._sessions[session_id] = worker
        return worker

    def _pick(
        self,
        ids: list[int],
        exclude: Sequence[WorkerClient],
        among: Sequence[WorkerClient] | None = None,
        lora: str | None = None,
    ) -> WorkerClient:
        """By the policy, among `among` (the generating workers by default) that are up; for a
        LoRA request, among those that serve its adapter (a worker that joined gets the router's
        run-time loads first), preferring those that had it last (see `RoutingPolicy`)."""
        among = self.workers if among is None else among
        up = [w for w in among if w.up and w not in exclude]
        if lora in self._adapters:
            up = [w for w in up if lora in w.loaded_adapters]
        if not up:
            details = "; ".join(f"{w.address}: {w.detail or 'failed'}" for w in among)
            raise EngineDeadError(f"no worker is available ({details})")
        key = adapter_key(ids, None if lora is None else self._routed_adapter(lora).number)
        resident = None if lora is None else [lora in w.recent_adapters for w in up]
        index = choose_replica(
            [w.tree.match(key) for w in up], [w.in_flight for w in up], len(ids), self.policy, resident
        )
        return up[index]

    async def _run(
        self,
        group_id: str,
        index: int,
        placed: _Placed,
        ids: list[int],
        params: SamplingParams,
        seed: int | None,
        session_id: str | None,
        out: asyncio.Queue,
    ) -> None:
        """Generate one choice on `placed.worker`, moving it to another worker while nothing was
        streamed; its deltas (or the error that ends it) go to `out`."""
        sequence = RemoteSequence(group_id, index, ids, params, self.info.tokenizer)
        wanted = worker_params(params, seed)
        request = pb.GenerateRequest(
            request_id=placed.request_id,
            prompt_token_ids=ids,
            sampling_params_json=params_to_json(wanted),
            session_id=session_id or "",
        )
        try:
            await self._stream_retrying(placed, request, wanted, sequence, out, ids, session_id)
        except (ValueError, EngineDeadError, RequestFailedError) as e:
            out.put_nowait(e)

    async def _stream_retrying(
        self,
        placed: _Placed,
        request: pb.GenerateRequest,
        wanted: SamplingParams,
        sequence: RemoteSequence,
        out: asyncio.Queue,
        ids: list[int],
        session_id: str | None,
        cached_tokens: int | None = None,
    ) -> None:
        """Stream `request` (`wanted`: its sequence's worker params) on `placed.worker` to the
        sequence's end. A worker that fails is marked down and the sequence goes on on another one
        that is up: the same request when the worker streamed nothing of it (with a decode half,
        its KV source too: the lease is still held, or the new worker recomputes), else the rest of
        the sequence from the prompt plus the tokens out so far (`_resume_request`)."""
        tried: list[tuple[WorkerClient, str | None]] = []  # a worker, and its instance that failed
        while True:
            worker = placed.worker
            tried.append((worker, worker.instance_id))
            streamed = sequence.num_out
            try:
                if await stream_once(
                    worker,
                    request,
                    sequence,
                    out,
                    cached_tokens,
                    self._count_transfer,
                    self._routed_adapter(wanted.lora),
                    self.policy.adapter_slots,
                ):
                    return
                error = "the stream ended without a final message"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(e.details()) from None
                if e.code() == grpc.StatusCode.NOT_FOUND:  # an adapter unloaded meanwhile
                    raise UnknownAdapterError(e.details()) from None
                error = f"{e.code().name}: {e.details()}"
            worker.mark_down(error)
            resumed = sequence.num_out > streamed
            if resumed:
                if not resumes(wanted):
                    raise WorkerLostError(
                        f"worker {worker.address} failed while generating ({error}); a sequence "
                        "with presence or frequency penalties or a grammar cannot resume elsewhere"
                    )
                if self._ended_by_length(sequence, ids, wanted):
                    out.put_nowait(sequence.delta("length", sequence.stop_usage(cached_tokens or 0)))
                    return
                request = self._resume_request(request, wanted, sequence, ids)
            placed.worker = self._pick(
                ids, exclude=[w for w, instance in tried if w.instance_id == instance], lora=wanted.lora
            )
            logger.warning(
                "worker %s failed after streaming %d of %s's tokens (%s); %s on %s",
                worker.address,
                sequence.num_out - streamed,
                request.request_id,
                error,
                "resuming it" if resumed else "retrying",
                placed.worker.address,
            )
            if session_id is not None:
                self._sessions[session_id] = placed.worker

    def _ended_by_length(self, sequence: RemoteSequence, ids: list[int], wanted: SamplingParams) -> bool:
        """The sequence has all the tokens it may have (its worker failed before it said so)."""
        return sequence.num_out >= wanted.max_tokens or len(ids) + sequence.num_out >= self.info.max_model_len

    @staticmethod
    def _resume_request(
        request: pb.GenerateRequest, wanted: SamplingParams, sequence: RemoteSequence, ids: list[int]
    ) -> pb.GenerateRequest:
        """The rest of a sequence: the prompt plus its tokens so far, generating what is left of its
        budget (the KV of those tokens is recomputed on the worker that takes it)."""
        return pb.GenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=ids + sequence.token_ids,
            sampling_params_json=params_to_json(decode_params(wanted, sequence.num_out)),
            session_id=request.session_id,
        )

    async def _run_split(
        self,
        group_id: str,
        index: int,
        placed: _Placed,
        ids: list[int],
        params: SamplingParams,
        seed: int | None,
        session_id: str | None,
        out: asyncio.Queue,
    ) -> None:
        """Prefill on a prefill worker, decode on `placed.worker` with the KV it pulls from there.
        Without a prefill worker up, or when the prefill worker fails before its token, `_run`."""
        wanted = worker_params(params, seed)
        sequence = RemoteSequence(group_id, index, ids, params, self.info.tokenizer)
        try:
            prefill = self._pick(ids, exclude=(), among=self.prefill_workers)
        except EngineDeadError:
            return await self._run(group_id, index, placed, ids, params, seed, session_id, out)
        placed.prefill = prefill
        request = pb.GenerateRequest(
            request_id=placed.request_id,
            prompt_token_ids=ids,
            hold_kv=True,
            sampling_params_json=params_to_json(prefill_params(wanted)),
        )
        lease = None
        try:
            try:
                last = await prefill_once(prefill, request, sequence)
                error = "the stream ended without a final message"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(e.details()) from None
                last, error = None, f"{e.code().name}: {e.details()}"
            if last is None:
                prefill.mark_down(error)
                logger.warning(
                    "prefill worker %s failed on %s; generating it on %s alone",
                    prefill.address,
                    placed.request_id,
                    placed.worker.address,
                )
                return await self._run(group_id, index, placed, ids, params, seed, session_id, out)
            lease = last.lease if last.HasField("lease") else None
            usage = usage_from_message(last) or Usage(len(ids), sequence.num_out, 0)
            ends = (
                last.finish_reason != "length"
                or sequence.num_out >= params.max_tokens
                or len(ids) + sequence.num_out >= self.info.max_model_len
            )
            if sequence.stopped or ends:
                reason = "stop" if sequence.stopped else last.finish_reason
                out.put_nowait(sequence.delta(reason, sequence.stop_usage(usage.cached_tokens)))
                return
            delta = sequence.delta(None, None)  # the first token goes out now
            if delta is not None:
                out.put_nowait(delta)
            rest = pb.GenerateRequest(
                request_id=placed.request_id,
                prompt_token_ids=ids + sequence.token_ids,
                sampling_params_json=params_to_json(decode_params(wanted, sequence.num_out)),
                session_id=session_id or "",
                kv_source=pb.KVSource(address=prefill.address, lease=lease) if lease is not None else None,
            )
            await self._stream_retrying(placed, rest, wanted, sequence, out, ids, session_id, usage.cached_tokens)
            lease = None  # the decode worker released it
        except (ValueError, EngineDeadError, RequestFailedError) as e:
            out.put_nowait(e)
        finally:
            if lease is not None:  # the decode half never ran to the end: free the prefill's blocks now
                self._spawn(
                    prefill.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=CALL_TIMEOUT)
                )

    def _count_transfer(self, t: pb.KVTransfer) -> None:
        self.transfers = with_transfer(self.transfers, t)

    # ----- health ----------------------------------------------------------------------------

    async def check_workers(self) -> None:
        """One health check of every worker; a worker that (re)joined is set up afresh."""
        everyone = self.workers + self.prefill_workers
        restarted = await asyncio.gather(*(w.refresh(self._reference) for w in everyone))
        for worker, fresh in zip(everyone, restarted):
            if not fresh:
                continue
            if self._reference is None:
                self._reference = worker.info
            if worker in self.prefill_workers:
                continue
            for session_id in [s for s, w in self._sessions.items() if w is worker]:
                del self._sessions[session_id]  # their KV is gone with the old process
            if self._pin_budget is not None:
                await self._send_pin_budget(worker)
        await asyncio.gather(
            *(self._send_adapters(w) for w in self.workers if w.up and not w.loaded_adapters.issuperset(self._adapters))
        )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_workers()
            except Exception:  # noqa: BLE001 - keep checking
                logger.exception("worker health check failed")

    async def _send_adapters(self, worker: WorkerClient) -> None:
        """The adapters loaded through the router that a worker lacks (it joined, restarted or was
        down at the load): until one is loaded there, requests for it go to other workers."""
        for name, path in list(self._adapters.items()):
            if name in worker.loaded_adapters:
                continue
            try:
                await worker.stub.LoadLoraAdapter(pb.LoraAdapterRequest(name=name, path=path), timeout=CALL_TIMEOUT)
            except grpc.aio.AioRpcError as e:
                logger.warning(
                    "loading LoRA adapter %s on worker %s failed: %s: %s",
                    name,
                    worker.address,
                    e.code().name,
                    e.details(),
                )
                continue
            if self._adapters.get(name) == path:  # not unloaded meanwhile
                worker.loaded_adapters.add(name)

    async def _send_pin_budget(self, worker: WorkerClient) -> None:
        await self._quietly(
            worker,
            worker.stub.SetPinBudget(pb.SetPinBudgetRequest(blocks_per_owner=self._pin_budget), timeout=CALL_TIMEOUT),
        )

    @staticmethod
    async def _quietly(worker: WorkerClient, call: grpc.aio.UnaryUnaryCall) -> None:
        """Await a bookkeeping call; a worker that fails it is found by the health check."""
        try:
            await call
        except grpc.aio.AioRpcError as e:
            logger.warning("call to worker %s failed: %s", worker.address, e.code().name)

    def _spawn(self, call: grpc.aio.UnaryUnaryCall) -> None:
        async def run() -> None:
            try:
                await call
            except grpc.aio.AioRpcError:
                pass  # the request is gone with its worker

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
