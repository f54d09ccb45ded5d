"""The operations of `EngineCore` beyond the request loop, over the engine's own members:
`LLMEngine` inherits them, so callers above a replica never read its scheduler, KV manager,
LoRA manager or runner themselves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxserve import kv_transfer
from jaxserve.engine_client import BlockLayout, KVHold, Pin
from jaxserve.engine_lora_ops import ReplicaLoraOps
from jaxserve.kv_tiers import kv_fingerprint

if TYPE_CHECKING:
    from jaxserve.kv import KVCacheManager
    from jaxserve.kv.kv_events import KVEventLog
    from jaxserve.runner import ModelRunner
    from jaxserve.scheduler import Scheduler


class EngineCoreOps(ReplicaLoraOps):
    """Placement answers, pins and holds, KV block I/O (and LoRA adapters: `ReplicaLoraOps`) of one engine."""

    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    model_name: str

    # ----- placement -----------------------------------------------------------------------

    @property
    def load(self) -> int:
        """Unfinished sequences (running, waiting or swapped)."""
        return self.scheduler.num_unfinished

    def _cache_ids(self, token_ids: Sequence[int], lora: str | None) -> list[int] | None:
        """`token_ids` as the prefix cache keys them for adapter `lora`; None when it is not served."""
        if lora is None or not token_ids:
            return list(token_ids)
        return None if self.lora is None else self.lora.cache_ids(lora, list(token_ids))

    def prefix_match_length(self, token_ids: Sequence[int], lora: str | None = None) -> int:
        """Tokens of `token_ids` this engine's prefix cache holds (adapter `lora`'s own KV only)."""
        ids = self._cache_ids(token_ids, lora)
        return 0 if ids is None else self.kv.match_prefix(ids).num_tokens

    def adapter_resident(self, name: str) -> bool:
        return self.lora is not None and self.lora.is_resident(name)

    def bucket_summary(self) -> str:
        """The shape buckets this engine compiles."""
        return self.runner.bucket_summary()

    # ----- session pins and transfer holds -------------------------------------------------

    def pin_history(
        self, owner: str, token_ids: list[int], old: Pin | None, others: list[Pin], lora: str | None = None
    ) -> tuple[Pin | None, list[Pin]]:
        """Pin a session's history (see `Leases.pin_within_budget`). A session of adapter `lora`
        pins the blocks its adapter computed; when the adapter is not served any more nothing is
        pinned and `old` released."""
        ids = self._cache_ids(token_ids, lora)
        if ids is None:
            return (None, [old]) if old is not None and self.unpin(old) else (None, [])
        return self.kv.leases.pin_within_budget(owner, ids, old, others)

    def unpin(self, pin: Pin) -> bool:
        """Release `pin` if this engine holds it (True), else nothing."""
        if not (pin.active and self.kv.leases.holds_pin(pin)):
            return False
        self.kv.leases.unpin(pin)
        return True

    def set_pin_budget(self, blocks_per_owner: int) -> None:
        self.kv.leases.budget_per_owner = blocks_per_owner

    def hold_prefix(self, token_ids: Sequence[int], max_blocks: int | None = None) -> KVHold:
        """Hold the cached full blocks of `token_ids` (up to `max_blocks`) until `release_hold`."""
        return self.kv.leases.hold_prefix(token_ids, max_blocks)

    def release_hold(self, hold: KVHold) -> None:
        if hold.active:
            self.kv.leases.release_hold(hold)

    # ----- KV blocks in and out (see jaxserve/kv_transfer.py) ------------------------------

    def kv_block_layout(self) -> BlockLayout:
        return kv_transfer.block_layout(self.runner)

    def kv_handoff_fingerprint(self) -> bytes:
        """What keys handed-over blocks: weights, dtype and layout, one row per model layer."""
        return kv_fingerprint(self.runner, self.model_name, model_layers=True)

    def read_kv_blocks(self, hold: KVHold, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return kv_transfer.read_blocks(self.runner, hold, first, count)

    def write_kv_blocks(self, hold: KVHold, token_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> KVHold:
        return kv_transfer.write_blocks(self.runner, self.kv, hold, token_ids, k, v)

    def stage_kv_blocks(self, hold: KVHold, first: int, count: int) -> list[jax.Array]:
        return kv_transfer.stage_blocks(self.runner, hold, first, count)

    def write_staged_kv_blocks(
        self, hold: KVHold, token_ids: Sequence[int], arrays: list[jax.Array], num_blocks: int
    ) -> KVHold:
        return kv_transfer.write_staged_blocks(self.runner, self.kv, hold, token_ids, arrays, num_blocks)

    def start_device_transfer(self, host: str) -> kv_transfer.DeviceTransfer:
        """A transfer server on `host` for device-to-device pulls (ValueError for uneven pipeline
        stages: they hand KV over as bytes)."""
        kv_transfer.check_device_layout(self.runner)
        return kv_transfer.DeviceTransfer(self.runner, host)

    def kv_event_log(self) -> KVEventLog | None:
        """The prefix cache's changes for a router (None: not recorded, --no-kv-events)."""
        return self.kv.events
