"""One call of the router to one worker: a generation streamed to its end or to the worker's
failure (`stream_once`), a prefill half (`prefill_once`), and the bookkeeping of a KV transfer.
What to do when a call fails (retry, resume, another worker) is `SequenceRunner`'s business."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import grpc

from jaxserve.engine_client import RequestFailedError
from jaxserve.engine_snapshot import KVTransferStats, load_seconds_bucket
from jaxserve.outputs import Usage
from server.cluster.router.sequence import RemoteSequence
from server.cluster.router.worker_client import WorkerClient
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import cache_ids_of, embedding_from_message, usage_from_message

CALL_TIMEOUT = 30.0  # seconds a unary call (pins, loads, aborts) may take


async def stream_once(
    worker: WorkerClient,
    request: pb.GenerateRequest,
    sequence: RemoteSequence,
    out: asyncio.Queue,
    cached_tokens: int | None,
    on_transfer: Callable[[pb.KVTransfer], None],
    lora: str | None = None,
    lora_slots: int = 1,
) -> bool:
    """One try on one worker; True when the sequence has ended. Deltas go to `out`, the KV
    transfers the worker reports (a decode half's pull) to `on_transfer`; the prompt goes into the
    worker's cache picture with adapter `lora` (see `SentPrefixes.note`). When the request's prompt holds
    output tokens (a decode half, a resumed sequence), usage is the router's count: the original
    prompt and every output token, with `cached_tokens` (the prefill worker's prefix hit) or
    else the share of the original prompt this worker found cached."""

    def usage_of(cached: int) -> Usage:
        return sequence.stop_usage(cached_tokens if cached_tokens is not None else min(cached, sequence.num_prompt))

    worker.routed += 1
    worker.sent.note(cache_ids_of(request.prompt_token_ids, request.images), lora, lora_slots)
    call = worker.stub.Generate(request)
    try:
        async for msg in call:
            if msg.finish_reason == "error":
                raise RequestFailedError(msg.error or "the worker failed this request")
            if msg.HasField("transfer"):
                on_transfer(msg.transfer)
            if sequence.feed(msg):  # a stop string: end the text here, and on the worker
                cached = await end_on_worker(worker, request.request_id, call)
                out.put_nowait(sequence.delta("stop", usage_of(cached)))
                return True
            usage = usage_from_message(msg)
            if usage is not None and len(request.prompt_token_ids) != sequence.num_prompt:
                usage = usage_of(usage.cached_tokens)
            delta = sequence.delta(msg.finish_reason or None, usage)
            if delta is not None:
                delta.embedding = embedding_from_message(msg)
                out.put_nowait(delta)
            if msg.finish_reason:
                return True
        return False
    finally:
        call.cancel()  # a no-op once the call is over; else the worker aborts the request


async def end_on_worker(worker: WorkerClient, request_id: str, call: grpc.aio.UnaryStreamCall) -> int:
    """Abort a sequence the router ended; the prompt tokens the worker had cached (from its last message)."""
    try:
        await worker.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=CALL_TIMEOUT)
        async for msg in call:
            if msg.finish_reason:
                return msg.usage.cached_tokens
    except grpc.aio.AioRpcError:
        pass
    return 0


async def prefill_once(
    prefill: WorkerClient, request: pb.GenerateRequest, sequence: RemoteSequence
) -> pb.GenerateResponse | None:
    """Run the prefill half; its tokens are fed to `sequence`; returns its last message (None
    when the stream ended without one)."""
    prefill.in_flight += 1
    prefill.routed += 1
    prefill.sent.note(cache_ids_of(request.prompt_token_ids, request.images), None)
    call = prefill.stub.Generate(request)
    try:
        async for msg in call:
            if msg.finish_reason == "error":
                raise RequestFailedError(msg.error or "the prefill worker failed this request")
            if not sequence.stopped:
                sequence.feed(msg)
            if msg.finish_reason:
                return msg
        return None
    finally:
        call.cancel()
        prefill.in_flight -= 1


def with_transfer(stats: KVTransferStats, t: pb.KVTransfer) -> KVTransferStats:
    """`stats` with one more KV transfer (a decode worker's pull, as it reported it)."""
    bucket = load_seconds_bucket(t.seconds)
    return dataclasses.replace(
        stats,
        transfers=stats.transfers + 1,
        device_transfers=stats.device_transfers + (t.transport == "device"),
        blocks_pulled=stats.blocks_pulled + t.blocks_pulled,
        blocks_skipped=stats.blocks_skipped + t.blocks_skipped,
        bytes=stats.bytes + t.bytes,
        seconds=stats.seconds + t.seconds,
        failed=stats.failed + bool(t.error),
        seconds_counts=tuple(n + (i == bucket) for i, n in enumerate(stats.seconds_counts)),
    )
