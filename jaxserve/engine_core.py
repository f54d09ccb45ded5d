"""`EngineCore`: what one engine replica offers the layers above it.

The data-parallel engine (`jaxserve.data_parallel`), the async engine and its KV export and import
(`jaxserve.async_engine`, `jaxserve.async_kv_transfer`, which the worker service and the KV handoff
reach through `KVTransferEngine`) use a replica through these operations only: none of them reads a
replica's scheduler, KV manager, LoRA manager or runner. `LLMEngine` implements it (the operations
beyond its request loop are in `jaxserve.engine_core_ops.EngineCoreOps`). A replica is also a
`jaxserve.placement.PlacementTarget` (load, prefix match length, adapter residency).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jaxserve.engine_client import BlockLayout, KVHold, Pin
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.image_prompt import MultimodalPrompt, PromptImage
from jaxserve.lora.peft import LoraWeights
from jaxserve.outputs import Delta
from jaxserve.placement import PlacementTarget
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import jax

    from jaxserve.kv.kv_events import KVEventLog
    from jaxserve.kv_transfer import DeviceTransfer


class ReplicaRequests(Protocol):
    """Requests and steps (the `LLMEngine` loop)."""

    def encode_prompt(self, prompt: str | list[int] | MultimodalPrompt) -> list[int]: ...
    def add_prompt_ids(
        self, request_id: str, ids: list[int], params: SamplingParams, images: tuple[PromptImage, ...] = ()
    ) -> list[Request]: ...
    def step(self) -> list[Delta]: ...
    def abort(self, request_id: str) -> list[Delta]: ...
    def has_unfinished_requests(self) -> bool: ...
    def is_active(self, request_id: str) -> bool: ...
    def warm_up(self) -> float: ...
    def snapshot(self) -> EngineSnapshot: ...
    def bucket_summary(self) -> str: ...
    def close(self) -> None: ...
    @property
    def num_compilations(self) -> int: ...


class SessionPins(Protocol):
    """Session histories pinned in the prefix cache, within a budget per owner."""

    def pin_history(
        self, owner: str, token_ids: list[int], old: Pin | None, others: list[Pin], lora: str | None = None
    ) -> tuple[Pin | None, list[Pin]]: ...
    def unpin(self, pin: Pin) -> bool: ...
    def set_pin_budget(self, blocks_per_owner: int) -> None: ...


class KVBlockIO(Protocol):
    """Cached KV blocks held, read out and written in (prefill/decode disaggregation)."""

    def hold_prefix(self, token_ids: Sequence[int], max_blocks: int | None = None) -> KVHold: ...
    def release_hold(self, hold: KVHold) -> None: ...
    def kv_block_layout(self) -> BlockLayout: ...
    def kv_handoff_fingerprint(self) -> bytes: ...
    def read_kv_blocks(self, hold: KVHold, first: int, count: int) -> tuple[np.ndarray, np.ndarray]: ...
    def write_kv_blocks(self, hold: KVHold, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> KVHold: ...
    def stage_kv_blocks(self, hold: KVHold, first: int, count: int) -> list[jax.Array]: ...
    def write_staged_kv_blocks(
        self, hold: KVHold, token_ids: Sequence[int], arrays: list[jax.Array], num_blocks: int
    ) -> KVHold: ...
    def start_device_transfer(self, host: str) -> DeviceTransfer: ...
    def kv_event_log(self) -> KVEventLog | None: ...


class ReplicaLora(Protocol):
    """LoRA adapters served, and their host copies (read off the engine thread)."""

    def read_lora(self, path: str) -> LoraWeights: ...
    def missing_lora_host_copy(self, name: str) -> str | None: ...
    def keep_lora(self, name: str, path: str, weights: LoraWeights) -> None: ...
    def add_lora(self, name: str, path: str, weights: LoraWeights | None = None) -> None: ...
    def remove_lora(self, name: str) -> None: ...
    def lora_adapters(self) -> dict[str, str]: ...


class EngineCore(ReplicaRequests, PlacementTarget, SessionPins, KVBlockIO, ReplicaLora, Protocol):
    """One engine replica: requests and steps, its prefix cache and LoRA slots as placement
    sees them, session pins, KV blocks in and out, LoRA adapters. Not thread-safe: one thread
    (the engine thread) calls it."""

    config: Any  # jaxserve.config.EngineConfig, as resolved for the model
    model_config: Any
    model_name: str
    tokenizer: Any  # jaxserve.tokenizer.Tokenizer
    stats: Any  # jaxserve.output_processor.StepStats
