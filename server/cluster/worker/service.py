"""The worker's servicer: the `Worker` service of `worker.proto` over one engine (`KVTransferEngine`).

Each Generate call is one sequence (n = 1); the router expands choices and applies stop
strings. Session pins live in the engine's prefix cache; the router holds them by the ids this
servicer hands out (the Pin objects cannot cross the wire). Prefill/decode disaggregation (KV
leases, pulls) is `kv_handoff`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from checkpoints.hf_vision import vision_to_json
from jaxserve.engine_client import EngineDeadError, KVTransferEngine, Pin, RequestFailedError, UnknownAdapterError
from jaxserve.image_prompt import MultimodalPrompt
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker import worker_pb2_grpc
from server.cluster.worker.kv_handoff import KVHandoff, LeaseGoneError
from server.cluster.worker.wire import (
    PROTOCOL_VERSION,
    cache_ids_of,
    delta_to_message,
    images_from_messages,
    params_from_json,
    snapshot_to_json,
)
from server.routes_ops import engine_problem

logger = logging.getLogger(__name__)

KV_EVENTS_POLL_SECONDS = 0.02  # how often a KVEvents stream looks for new changes


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: KVTransferEngine, role: str = "both", handoff: KVHandoff | None = None) -> None:
        self._engine = engine
        self._role = role
        self._handoff = handoff  # None: no disaggregation here
        self.instance_id = uuid.uuid4().hex
        self._pins: dict[int, Pin] = {}
        self._pin_ids = itertools.count(1)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        info = self._engine.info
        bundle = info.tokenizer.bundle
        return pb.InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            instance_id=self.instance_id,
            model=info.model_name,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
            max_num_seqs=info.max_num_seqs,
            block_size=info.block_size,
            role=self._role,
            tokenizer_json=bundle.tokenizer.to_str(),
            chat_template=bundle.chat_template,
            special_tokens=bundle.special_tokens,
            eos_token_ids=bundle.eos_token_ids,
            hidden_size=info.hidden_size,
            encoder_config_json=json.dumps(dataclasses.asdict(info.encoder)) if info.encoder is not None else "",
            vision_config_json=vision_to_json(info.vision) if info.vision is not None else "",
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        hold, leased_out = None, False
        try:
            params = params_from_json(request.sampling_params_json)
            if params.n != 1:
                raise ValueError("a worker request generates one sequence (n = 1)")
            self._check_handoff(request)
            if params.lora is not None and (request.hold_kv or request.HasField("kv_source")):
                raise ValueError("KV handoff (hold_kv, kv_source) does not carry a LoRA adapter's KV")
            ids = list(request.prompt_token_ids)
            images = images_from_messages(request.images, ids, self._engine.info.vision)
            cache_ids = cache_ids_of(ids, request.images)  # as the prefix cache keys the prompt (its images salted)
            transfer = None
            if request.HasField("kv_source"):
                hold, transfer = await self._handoff.pull_into_cache(cache_ids, request.kv_source)
            prompt = MultimodalPrompt(ids, images) if images else ids
            stream = self._engine.generate(
                request.request_id, prompt, params, request.session_id or None, hold_kv=request.hold_kv
            )
            async with aclosing(stream):  # leaving early (the call cancelled) aborts the request
                async for delta in stream:
                    msg = delta_to_message(delta)
                    if transfer is not None:
                        msg.transfer.CopyFrom(transfer)
                        transfer = None
                    if hold is not None:  # admitted: the request's own blocks keep the prefix now
                        self._handoff.release_hold(hold)
                        hold = None
                    if delta.kv_hold is not None:
                        msg.lease.CopyFrom(self._handoff.lease(request.request_id, cache_ids, delta.kv_hold))
                    if request.hold_kv and delta.finished:
                        # Handed over: a caller that reads this message may cancel the call at once
                        # (the router does); one that never reads it leaves the lease to its timeout.
                        leased_out = True
                    yield msg
        except UnknownAdapterError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except RequestFailedError as e:
            yield pb.GenerateResponse(finish_reason="error", error=str(e))
        finally:
            if self._handoff is not None:
                self._handoff.release_hold(hold)
                if request.hold_kv and not leased_out:  # the caller went away before it heard of the lease
                    self._handoff.drop_leases(request.request_id)

    def _check_handoff(self, request: pb.GenerateRequest) -> None:
        for wanted, roles, what in (
            (request.hold_kv, ("prefill", "both"), "hold_kv"),
            (request.HasField("kv_source"), ("decode", "both"), "kv_source"),
        ):
            if wanted and (self._handoff is None or self._role not in roles):
                raise ValueError(
                    f"{what} needs a worker started with --role {' or '.join(roles)} "
                    f"(one engine replica); this one is --role {self._role}"
                )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self._engine.abort(request.request_id)
        if self._handoff is not None:
            await self._handoff.abort(request.request_id)
        return pb.AbortResponse()

    async def PullKV(self, request: pb.PullKVRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KVBlocks]:
        if self._handoff is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker holds no KV leases")
        try:
            async for msg in self._handoff.read(request):
                yield msg
        except LeaseGoneError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def StageKV(self, request: pb.PullKVRequest, context: grpc.aio.ServicerContext) -> pb.StageKVResponse:
        if self._handoff is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker holds no KV leases")
        try:
            return await self._handoff.stage(request)
        except LookupError as e:  # LeaseGoneError, or no transfer server here
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeaseResponse:
        released = self._handoff is not None and await self._handoff.release_lease(request.lease_id)
        return pb.ReleaseLeaseResponse(released=released)

    async def KVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        try:
            source = self._engine.kv_events()
        except ValueError as e:  # several engine replicas in this process
            source, why = None, str(e)
        else:
            why = "this worker does not record KV events (prefix caching off, or --no-kv-events)"
        if source is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        block_size = self._engine.info.block_size
        seq = -1
        while True:
            batches = None if seq < 0 else source.since(seq)
            if batches is None:  # the first message, or this reader fell behind what the log keeps
                seq, keys = source.snapshot()
                yield pb.KVEventBatch(seq=seq, snapshot=True, stored=keys, seed=source.seed, block_size=block_size)
                continue
            for b in batches:
                yield pb.KVEventBatch(seq=b.seq, stored=b.stored, removed=b.removed, cleared=b.cleared)
                seq = b.seq
            if not batches:
                await asyncio.sleep(KV_EVENTS_POLL_SECONDS)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        problem = engine_problem(self._engine)
        return pb.HealthResponse(serving=problem is None, detail=problem or "", instance_id=self.instance_id)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        snapshot = await self._engine.snapshot()
        if snapshot is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine loop is not running")
        return pb.LoadResponse(
            running=snapshot.running,
            waiting=snapshot.waiting,
            kv_used=snapshot.kv.used,
            kv_blocks=snapshot.kv.num_blocks,
            kv_requests=snapshot.kv_requests,
            snapshot_json=snapshot_to_json(snapshot),
            kv_leases=len(self._handoff.leases) if self._handoff is not None else 0,
        )

    async def PinHistory(
        self, request: pb.PinHistoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.PinHistoryResponse:
        old = self._pins.get(request.old_pin)
        others = [self._pins[i] for i in request.others if i in self._pins]
        ids = {id(self._pins[i]): i for i in (*request.others, request.old_pin) if i in self._pins}
        history = list(request.cache_token_ids or request.token_ids)  # (salted where it holds images)
        lora = request.lora or None
        result = await self._engine.pin_history(request.session_id, request.owner, history, old, others, lora)
        if result is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine loop is not running")
        pin, released = result
        reply = pb.PinHistoryResponse(released=[ids[id(p)] for p in released if id(p) in ids])
        for pin_id in reply.released:
            self._pins.pop(pin_id, None)
        if old is not None and not old.active:  # replaced by the new pin
            self._pins.pop(request.old_pin, None)
        if pin is not None:
            pin_id = next(self._pin_ids)
            self._pins[pin_id] = pin
            reply.pin, reply.num_blocks, reply.num_tokens = pin_id, pin.num_blocks, pin.num_tokens
        return reply

    async def Unpin(self, request: pb.UnpinRequest, context: grpc.aio.ServicerContext) -> pb.UnpinResponse:
        pin = self._pins.pop(request.pin, None)
        if pin is not None:
            await self._engine.unpin(pin)
        return pb.UnpinResponse()

    async def EndSessions(
        self, request: pb.EndSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.EndSessionsResponse:
        ended = [(s.session_id, self._pins.pop(s.pin, None)) for s in request.sessions]
        await self._engine.end_sessions(ended)
        return pb.EndSessionsResponse()

    async def LoadLoraAdapter(
        self, request: pb.LoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdaptersResponse:
        try:
            await self._engine.load_lora_adapter(request.name, request.path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return await self.ListLoraAdapters(pb.ListLoraAdaptersRequest(), context)

    async def UnloadLoraAdapter(
        self, request: pb.LoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdaptersResponse:
        try:
            await self._engine.unload_lora_adapter(request.name)
        except UnknownAdapterError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return await self.ListLoraAdapters(pb.ListLoraAdaptersRequest(), context)

    async def ListLoraAdapters(
        self, request: pb.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdaptersResponse:
        adapters = await self._engine.lora_adapters()
        if adapters is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine loop is not running")
        return pb.LoraAdaptersResponse(adapters=adapters, digests=self._engine.lora_adapter_digests())

    async def SetPinBudget(
        self, request: pb.SetPinBudgetRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetPinBudgetResponse:
        await self._engine.set_pin_budget(request.blocks_per_owner)
        return pb.SetPinBudgetResponse()
