"""One choice of a request run on workers to its end: retried on another worker when its worker
fails before streaming anything, resumed on another when it fails after (see `remote_engine`'s
docstring), prefilled on a prefill worker first when the request splits (disaggregation)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from jaxserve.engine_client import EngineDeadError, RequestFailedError, UnknownAdapterError
from jaxserve.engine_snapshot import KVTransferStats
from jaxserve.outputs import Usage
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer
from server.cluster.router.handover import decode_params, prefill_params, resumes, splits
from server.cluster.router.sequence import RemoteSequence, worker_params
from server.cluster.router.worker_calls import CALL_TIMEOUT, prefill_once, stream_once, with_transfer
from server.cluster.router.worker_client import WorkerClient
from server.cluster.router.worker_pool import WorkerPool
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import cache_ids_of, params_to_json, usage_from_message

logger = logging.getLogger(__name__)


class WorkerLostError(EngineDeadError):
    """The worker generating a sequence failed after part of it was streamed."""


@dataclasses.dataclass
class Placed:
    """One worker request of a call: a choice, and the worker generating it."""

    request_id: str
    worker: WorkerClient
    prefill: WorkerClient | None = None  # prefilling it (disaggregation)


@dataclasses.dataclass
class Choice:
    """One choice of a request as the router runs it; its deltas (or the error that ends it) go
    to `out`."""

    group_id: str
    index: int
    placed: Placed
    ids: list[int]
    params: SamplingParams
    seed: int
    session_id: str | None
    out: asyncio.Queue
    tokenizer: Tokenizer
    max_model_len: int
    images: tuple[pb.PromptImage, ...] = ()  # the prompt's images, as every worker request carries them

    @property
    def cache_ids(self) -> list[int]:
        """The prompt as prefix caches key it (its images' rows salted): what placement matches."""
        return cache_ids_of(self.ids, self.images)

    @property
    def wanted(self) -> SamplingParams:
        """What its workers are asked for (one sequence, this seed, no stop strings)."""
        return worker_params(self.params, self.seed)

    def new_sequence(self) -> RemoteSequence:
        return RemoteSequence(self.group_id, self.index, self.ids, self.params, self.tokenizer)

    def request(self, sequence: RemoteSequence, **fields: object) -> pb.GenerateRequest:
        """The worker request for what is left of the sequence (the prompt plus the tokens so far,
        generating the rest of its budget), with `fields` set."""
        return pb.GenerateRequest(
            request_id=self.placed.request_id,
            prompt_token_ids=self.ids + sequence.token_ids,
            sampling_params_json=params_to_json(decode_params(self.wanted, sequence.num_out)),
            session_id=self.session_id or "",
            images=self.images,
            **fields,
        )

    def has_all_tokens(self, sequence: RemoteSequence) -> bool:
        """The sequence has all the tokens it may have (by max_tokens or the context)."""
        return sequence.num_out >= self.params.max_tokens or len(self.ids) + sequence.num_out >= self.max_model_len


def _request_error(e: grpc.aio.AioRpcError) -> Exception | None:
    """The caller's error a worker reported (a bad request, an unknown adapter), or None: the
    worker failed."""
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(e.details())
    if e.code() == grpc.StatusCode.NOT_FOUND:  # an adapter unloaded meanwhile
        return UnknownAdapterError(e.details())
    return None


class SequenceRunner:
    """Runs choices on the pool's workers, counting the KV transfers the workers report."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.transfers = KVTransferStats()

    async def run(self, choice: Choice) -> None:
        """Generate one choice to its end (split between a prefill and a decode worker when the
        request splits and a prefill worker is up). The choice counts in its worker's load
        (`RemoteEngine.generate`); a retry elsewhere moves it."""
        try:
            if self.pool.prefill_workers and splits(choice.params):
                await self._run_split(choice)
            else:
                await self._run_whole(choice)
        except (ValueError, EngineDeadError, RequestFailedError) as e:
            choice.out.put_nowait(e)

    async def _run_whole(self, choice: Choice) -> None:
        sequence = choice.new_sequence()
        request = pb.GenerateRequest(
            request_id=choice.placed.request_id,
            prompt_token_ids=choice.ids,
            sampling_params_json=params_to_json(choice.wanted),
            session_id=choice.session_id or "",
            images=choice.images,
        )
        await self._stream_retrying(choice, request, sequence)

    async def _stream_retrying(
        self, choice: Choice, request: pb.GenerateRequest, sequence: RemoteSequence, cached_tokens: int | None = None
    ) -> None:
        """Stream `request` on `choice.placed.worker` to the sequence's end. A worker that fails is
        marked down and the sequence goes on on another one that is up: the same request when the
        worker streamed nothing of it (with a decode half, its KV source too: the lease is still
        held, or the new worker recomputes), else the rest of the sequence (`Choice.request`)."""
        placed, wanted = choice.placed, choice.wanted
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
                    choice.out,
                    cached_tokens,
                    self._count,
                    wanted.lora,
                    self.pool.policy.lora_slots,
                ):
                    return
                error = "the stream ended without a final message"
            except grpc.aio.AioRpcError as e:
                if (caller_error := _request_error(e)) is not None:
                    raise caller_error from None
                error = f"{e.code().name}: {e.details()}"
            worker.mark_down(error)
            resumed = sequence.num_out > streamed
            if resumed:
                if not resumes(wanted):
                    raise WorkerLostError(
                        f"worker {worker.address} failed while generating ({error}); a sequence "
                        "with presence or frequency penalties or a grammar cannot resume elsewhere"
                    )
                if choice.has_all_tokens(sequence):
                    choice.out.put_nowait(sequence.delta("length", sequence.stop_usage(cached_tokens or 0)))
                    return
                request = choice.request(sequence)
            exclude = [w for w, instance in tried if w.instance_id == instance]
            placed.worker = self.pool.pick(choice.cache_ids, exclude, lora=wanted.lora)
            worker.in_flight -= 1  # the choice's load moves with it
            placed.worker.in_flight += 1
            logger.warning(
                "worker %s failed after streaming %d of %s's tokens (%s); %s on %s",
                worker.address,
                sequence.num_out - streamed,
                request.request_id,
                error,
                "resuming it" if resumed else "retrying",
                placed.worker.address,
            )
            self.pool.placement.stick(choice.session_id, placed.worker)

    async def _run_split(self, choice: Choice) -> None:
        """Prefill on a prefill worker, decode on `choice.placed.worker` with the KV it pulls from
        there. Without a prefill worker up, or when the prefill worker fails before its token, the
        whole request runs on the decode worker."""
        try:
            prefill = self.pool.pick(choice.cache_ids, among=self.pool.prefill_workers)
        except EngineDeadError:
            return await self._run_whole(choice)
        choice.placed.prefill = prefill
        sequence = choice.new_sequence()
        last = await self._prefill(choice, prefill, sequence)
        if last is None:
            return await self._run_whole(choice)
        lease = last.lease if last.HasField("lease") else None
        try:
            await self._decode(choice, prefill, sequence, last, lease)
            lease = None  # the decode worker released it
        finally:
            if lease is not None:  # the decode half never ran to the end: free the prefill's blocks now
                release = pb.ReleaseLeaseRequest(lease_id=lease.lease_id)
                self.pool.spawn(prefill.stub.ReleaseLease(release, timeout=CALL_TIMEOUT))

    async def _prefill(
        self, choice: Choice, prefill: WorkerClient, sequence: RemoteSequence
    ) -> pb.GenerateResponse | None:
        """The prefill half's last message (its first token fed to `sequence`), or None when the
        prefill worker failed before it (marked down)."""
        request = pb.GenerateRequest(
            request_id=choice.placed.request_id,
            prompt_token_ids=choice.ids,
            hold_kv=True,
            sampling_params_json=params_to_json(prefill_params(choice.wanted)),
            images=choice.images,
        )
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
                choice.placed.request_id,
                choice.placed.worker.address,
            )
        return last

    async def _decode(
        self,
        choice: Choice,
        prefill: WorkerClient,
        sequence: RemoteSequence,
        last: pb.GenerateResponse,
        lease: pb.KVLease | None,
    ) -> None:
        """The decode half after the prefill half's `last` message: the sequence ends there when
        that token ended it, else the decode worker pulls the leased KV and generates the rest."""
        usage = usage_from_message(last) or Usage(len(choice.ids), sequence.num_out, 0)
        if sequence.stopped or last.finish_reason != "length" or choice.has_all_tokens(sequence):
            reason = "stop" if sequence.stopped else last.finish_reason
            choice.out.put_nowait(sequence.delta(reason, sequence.stop_usage(usage.cached_tokens)))
            return
        delta = sequence.delta(None, None)  # the first token goes out now
        if delta is not None:
            choice.out.put_nowait(delta)
        source = pb.KVSource(address=prefill.address, lease=lease) if lease is not None else None
        rest = choice.request(sequence, kv_source=source)
        await self._stream_retrying(choice, rest, sequence, usage.cached_tokens)

    def _count(self, t: pb.KVTransfer) -> None:
        self.transfers = with_transfer(self.transfers, t)
