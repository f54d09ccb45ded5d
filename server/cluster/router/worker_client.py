"""One worker as the router sees it: its connection, what it serves, whether it is up, its load.

`refresh` is the health check: a worker that answers Health and serves is up; one that does
not is down until a later check finds it serving again. A worker that comes back with another
instance id has restarted: its cache picture is cleared and the router is told (`restarted`),
so that sessions placed there are placed afresh and pin budgets sent again.

A worker is a `jaxserve.placement.PlacementTarget`: its load is the sequences the router has running
there; its cached prefixes what its KV events say it holds (`follow_kv_events`: a `KVIndex`) and
the router's picture of what it sent there (`SentPrefixes`: prompts in flight, and all there is
without an event stream: a worker that does not record them, LoRA prefixes); its resident
adapters the router's picture.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence

import grpc
import tokenizers

from checkpoints.encoders.config import EncoderConfig
from checkpoints.hf_vision import vision_from_json
from checkpoints.tokenizer_bundle import TokenizerBundle
from jaxserve.engine_client import EngineInfo, Pin
from jaxserve.placement.kv_index import KVIndex
from jaxserve.placement.sent_prefixes import SentPrefixes
from jaxserve.tokenizer import Tokenizer
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import PROTOCOL_VERSION
from server.cluster.worker.worker_pb2_grpc import WorkerStub
from server.tls import ClusterTLS, open_channel

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT = 2.0  # seconds a Health or Info call may take before the worker counts as down
MAX_MESSAGE_BYTES = 64 << 20  # Info carries the tokenizer (a few MB for large vocabularies)
# gRPC backs off up to 2 minutes between reconnects to an address that refused; a worker that
# restarts should be back within a health check or two.
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What a worker serves; every worker of a router must serve the same (`compatible_with`)."""

    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    tokenizer_json: str
    chat_template: str | None
    special_tokens: tuple[tuple[str, str], ...]
    eos_token_ids: tuple[int, ...]
    hidden_size: int
    encoder_config_json: str  # an encoder embedding model's config (empty: a decoder LM)
    vision_config_json: str = ""  # a vision-language model's tower (empty: no images)

    @classmethod
    def from_message(cls, msg: pb.InfoResponse) -> WorkerInfo:
        return cls(
            msg.model,
            msg.vocab_size,
            msg.max_model_len,
            msg.max_num_seqs,
            msg.block_size,
            msg.tokenizer_json,
            msg.chat_template if msg.HasField("chat_template") else None,
            tuple(sorted(msg.special_tokens.items())),
            tuple(msg.eos_token_ids),
            msg.hidden_size,
            msg.encoder_config_json,
            msg.vision_config_json,
        )

    def mismatch(self, other: WorkerInfo) -> str | None:
        """Why a worker serving `other` cannot join workers serving this, or None."""
        for field in (
            "model",
            "vocab_size",
            "max_model_len",
            "block_size",
            "tokenizer_json",
            "chat_template",
            "special_tokens",
            "eos_token_ids",
            "hidden_size",
            "encoder_config_json",
            "vision_config_json",
        ):
            if getattr(self, field) != getattr(other, field):
                return f"it serves another {field.replace('_', ' ')}"
        return None


class WorkerClient:
    def __init__(self, address: str, roles: tuple[str, ...] = ("both",), tls: ClusterTLS | None = None) -> None:
        self.address = address
        self._tls = tls  # mutual TLS to the worker, else plaintext
        self.roles = roles  # the --role values a worker at this address may have
        self.up = False
        self.detail = "not checked yet"
        self.info: WorkerInfo | None = None
        self.instance_id: str | None = None
        self.in_flight = 0  # sequences the router has running there
        self.routed = 0  # sequences the router has sent there since it started
        self.sent = SentPrefixes()  # what the router sent here: its cache picture
        self.loaded_adapters: set[str] = set()  # LoRA adapters the router loaded here (run-time loads)
        # every adapter it serves -> its weights' digest, the salt of its KV content keys (`kv_index`)
        self.adapter_digests: dict[str, bytes] = {}
        self.kv_index: KVIndex | None = None  # what its KV events say it holds (None: no stream)
        self.kv_events_refused = False  # the worker does not record KV events: do not ask again
        self._channel: grpc.aio.Channel | None = None
        self._stub: WorkerStub | None = None

    @property
    def stub(self) -> WorkerStub:
        """The stub, on a channel made on first use (inside the router's event loop)."""
        if self._stub is None:
            self._channel = open_channel(
                self.address, self._tls, [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *RECONNECT]
            )
            self._stub = WorkerStub(self._channel)
        return self._stub

    async def refresh(self, reference: WorkerInfo | None) -> bool:
        """Check the worker; True when it has restarted (or answered for the first time) since
        the last check that found it up. `reference` is what it must serve (None: anything)."""
        try:
            health = await self.stub.Health(pb.HealthRequest(), timeout=HEALTH_TIMEOUT)
            if not health.serving:
                self.mark_down(f"not serving: {health.detail}")
                return False
            restarted = health.instance_id != self.instance_id
            if restarted:
                info_msg = await self.stub.Info(pb.InfoRequest(), timeout=HEALTH_TIMEOUT)
                if info_msg.protocol_version != PROTOCOL_VERSION:
                    self.mark_down(f"worker protocol {info_msg.protocol_version}, router {PROTOCOL_VERSION}")
                    return False
                if info_msg.role not in self.roles:
                    self.mark_down(f"it is a --role {info_msg.role} worker, wanted {' or '.join(self.roles)}")
                    return False
                info = WorkerInfo.from_message(info_msg)
                problem = reference.mismatch(info) if reference is not None else None
                if problem is not None:
                    self.mark_down(f"incompatible: {problem}")
                    return False
                self.info, self.instance_id = info, info_msg.instance_id
                self.sent.clear()
                self.loaded_adapters.clear()
                listed = await self.stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=HEALTH_TIMEOUT)
                self.note_adapters(listed)
        except grpc.aio.AioRpcError as e:
            self.mark_down(f"{e.code().name}: {e.details()}")
            return False
        if not self.up:
            logger.info("worker %s is up", self.address)
        self.up, self.detail = True, ""
        return restarted

    # ----- placement (`jaxserve.placement.PlacementTarget`) ---------------------------------

    @property
    def load(self) -> int:
        return self.in_flight

    def note_adapters(self, reply: pb.LoraAdaptersResponse) -> None:
        """The adapters it serves, as a reply to a LoRA call lists them (their digests, for `kv_index`)."""
        self.adapter_digests = dict(reply.digests)

    def prefix_match_length(self, token_ids: Sequence[int], lora: str | None = None) -> int:
        """What its KV events say it holds, or what the router sent it (a prompt sent a moment ago
        is not computed, let alone reported, yet), whichever is longer. An adapter's blocks are
        keyed under its digest: matched in the events once the worker has said which it is."""
        sent = self.sent.match(token_ids, lora)
        index = self.kv_index
        if index is None or (lora is not None and lora not in self.adapter_digests):
            return sent
        return max(sent, index.match(token_ids, None if lora is None else self.adapter_digests[lora]))

    async def follow_kv_events(self) -> None:
        """Keep `kv_index` from the worker's KV events until the stream ends (the worker went
        down or restarted: the next health check that finds it up follows it again)."""
        try:
            async for batch in self.stub.KVEvents(pb.KVEventsRequest()):
                if batch.snapshot:
                    self.kv_index = KVIndex(batch.seed, batch.block_size, batch.stored)
                elif self.kv_index is not None:
                    self.kv_index.apply(batch.stored, batch.removed, batch.cleared)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                self.kv_events_refused = True
                why = e.details()
                logger.info("worker %s sends no KV events (%s): placing by what was sent there", self.address, why)
        finally:
            self.kv_index = None

    def adapter_resident(self, name: str) -> bool:
        return name in self.sent.recent_adapters

    def mark_down(self, detail: str) -> None:
        if self.up:
            logger.warning("worker %s is down: %s", self.address, detail)
        self.up, self.detail = False, detail

    def status(self) -> dict[str, object]:
        return {
            "address": self.address,
            "status": "up" if self.up else "down",
            "detail": self.detail,
            "in_flight": self.in_flight,
            "routed": self.routed,
        }

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def engine_info(info: WorkerInfo, num_workers: int) -> EngineInfo:
    """What the server reads of an engine at start-up, from a worker's `Info`."""
    bundle = TokenizerBundle(
        tokenizers.Tokenizer.from_str(info.tokenizer_json),
        info.chat_template,
        dict(info.special_tokens),
        info.eos_token_ids,
    )
    return EngineInfo(
        model_name=info.model,
        tokenizer=Tokenizer(bundle),
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        max_num_seqs=info.max_num_seqs * num_workers,
        block_size=info.block_size,
        hidden_size=info.hidden_size,
        encoder=EncoderConfig(**json.loads(info.encoder_config_json)) if info.encoder_config_json else None,
        vision=vision_from_json(info.vision_config_json) if info.vision_config_json else None,
    )


@dataclasses.dataclass(eq=False)
class RemotePin(Pin):
    """A pin held in a worker's cache, by the id the worker gave it."""

    worker: WorkerClient | None = None
    instance_id: str | None = None  # a restarted worker has lost it
    remote_id: int = 0

    def on(self, worker: WorkerClient) -> bool:
        return self.active and self.worker is worker and self.instance_id == worker.instance_id
