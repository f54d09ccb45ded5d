"""The adapters one engine serves: their names, host copies and LoRA slots.

`LoraManager` owns all of it. Names map to PEFT directories (`add`, `remove`); an adapter is read
from disk into a host copy (at most `max_cpu_loras` kept, least recently used dropped first) when
a request names it; a request runs only while its adapter sits in one of the `max_loras` device
LoRA slots, pinned there from admission until the request finishes or is preempted by recompute
(`acquire`, `release`). A LoRA slot no running request pins is reused for another adapter, least
recently used first; when every LoRA slot is pinned the request waits in the queue (it is not failed)
while others go.

The device copy is written through `write_adapter(lora_slot, weights)`, which the runner provides: this
module stays free of JAX (the scheduler calls it between steps).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from checkpoints.config import ModelConfig
from jaxserve.kv.content_keys import TOKEN_BITS, salt_token
from jaxserve.lora.peft import LoraWeights, load_peft_adapter

MAX_ADAPTER_UIDS = (1 << (31 - TOKEN_BITS)) - 1


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterRef:
    """The adapter a request runs with: its name, its weights (held by the request, so a request
    still runs after its adapter's name was removed) and `uid`, this process's number for those
    weights (the same bytes always get the same one)."""

    name: str
    uid: int
    weights: LoraWeights

    def salt(self, token: int) -> int:
        """A prompt's first token as the prefix cache keys it for this adapter: a negative id that
        no other adapter (nor the base model) gives, so their KV never shares a prefix."""
        return salt_token(self.uid, token)


@dataclasses.dataclass
class LoraStats:
    disk_loads: int = 0  # adapters read from disk into host memory
    device_loads: int = 0  # adapters written into a LoRA slot
    disk_load_seconds: float = 0.0
    device_load_seconds: float = 0.0
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by adapter name


class LoraManager:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        write_adapter: Callable[[int, LoraWeights], None],
    ) -> None:
        if config.vocab_size > 1 << TOKEN_BITS:
            raise ValueError(
                f"LoRA serving keys the prefix cache with vocabularies up to {1 << TOKEN_BITS} tokens; "
                f"this model has {config.vocab_size}"
            )
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._write_adapter = write_adapter
        self._paths: dict[str, str] = {}  # registered name -> directory
        self._digests: dict[str, bytes] = {}  # registered name -> its weights' digest (`LoraWeights.digest`)
        self._host: collections.OrderedDict[str, LoraWeights] = collections.OrderedDict()  # LRU last
        self._uids: dict[bytes, int] = {}  # weights digest -> uid
        self._lora_slot_uid: list[int | None] = [None] * max_loras
        self._pins = [0] * max_loras
        # LoRA slots in order of last use, least recent first.
        self._lora_slot_order: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(max_loras))
        self.stats = LoraStats()
        self._stats_lock = threading.Lock()

    # ----- names ----------------------------------------------------------------------------

    def read(self, path: str) -> LoraWeights:
        """The adapter at `path` read from disk (ValueError if it cannot be served). Of the
        manager's state it touches only the disk-load counts (under a lock): callers run it off the
        engine thread and hand the result to `add` or `keep`."""
        t0 = time.perf_counter()
        weights = load_peft_adapter(path, self.config, self.max_rank)
        with self._stats_lock:
            self.stats.disk_load_seconds += time.perf_counter() - t0
            self.stats.disk_loads += 1
        return weights

    def add(self, name: str, path: str, weights: LoraWeights | None = None) -> None:
        """Serve the PEFT adapter at `path` as `name`, with `weights` that `read(path)` returned
        (read now when None); ValueError if it cannot be served, or if the name is taken by another
        path."""
        if not name or not isinstance(name, str):
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self._paths:
            if self._paths[name] == path:
                return
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from {self._paths[name]!r})")
        if weights is None:
            weights = self.read(path)
        self._paths[name] = path
        self._digests[name] = weights.digest
        self.keep(name, path, weights)

    def keep(self, name: str, path: str, weights: LoraWeights) -> None:
        """Hold `weights` (read from `path` off the engine thread) as `name`'s host copy, unless
        `name` now names another directory or nothing."""
        if self._paths.get(name) != path:
            return
        self._host[name] = weights
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def missing_host_copy(self, name: str) -> str | None:
        """The directory of `name` when it is served but has no host copy (a request for it would
        read the disk); None otherwise."""
        return self._paths.get(name) if name not in self._host else None

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if unknown). Requests already queued with it finish."""
        del self._paths[name]
        del self._digests[name]
        self._host.pop(name, None)

    def names(self) -> dict[str, str]:
        """Served adapter names and their directories."""
        return dict(self._paths)

    def digests(self) -> dict[str, bytes]:
        """Served adapter names and their weights' digests: the salt of their requests' KV content keys
        (`ChainKeys.salted`), which a router needs to follow their blocks in the KV events. A plain
        dict copy: safe off the engine thread, at worst a stale answer."""
        return dict(self._digests)

    def resolve(self, name: str) -> AdapterRef:
        """The adapter a new request named `name` runs with (KeyError if no adapter has that name)."""
        if name not in self._paths:
            raise KeyError(name)
        weights = self._host_copy(name)
        uid = self._uids.get(weights.digest)
        if uid is None:
            if len(self._uids) >= MAX_ADAPTER_UIDS:
                raise ValueError(f"this engine has served {MAX_ADAPTER_UIDS} different adapters, its limit")
            uid = self._uids[weights.digest] = len(self._uids) + 1
        self.stats.requests[name] += 1
        return AdapterRef(name, uid, weights)

    def cache_ids(self, name: str, token_ids: list[int]) -> list[int] | None:
        """A prompt's ids as the prefix cache keys them for a request of adapter `name` (its first
        token salted), without counting a request; None when this engine has no number for the
        adapter's bytes yet (then none of its KV is cached here)."""
        weights = self._host.get(name)
        uid = None if weights is None else self._uids.get(weights.digest)
        if uid is None or not token_ids:
            return None
        return [salt_token(uid, token_ids[0]), *token_ids[1:]]

    def is_resident(self, name: str) -> bool:
        """Whether adapter `name`'s weights sit in a LoRA slot now."""
        weights = self._host.get(name)
        uid = None if weights is None else self._uids.get(weights.digest)
        return uid is not None and uid in self._lora_slot_uid

    def _host_copy(self, name: str) -> LoraWeights:
        weights = self._host.get(name)
        if weights is None:
            weights = self.read(self._paths[name])
            self.keep(name, self._paths[name], weights)
        self._host.move_to_end(name)
        return weights

    # ----- LoRA slots ---------------------------------------------------------------------

    def acquire(self, adapter: AdapterRef) -> int | None:
        """The LoRA slot holding `adapter`, pinned for one more request (written there first if
        it is not resident); None when every LoRA slot is pinned by other adapters' requests."""
        if adapter.uid in self._lora_slot_uid:
            lora_slot = self._lora_slot_uid.index(adapter.uid)
        else:
            free = [s for s in self._lora_slot_order if self._pins[s] == 0]  # least recently used first
            if not free:
                return None
            lora_slot = free[0]
            t0 = time.perf_counter()
            self._lora_slot_uid[lora_slot] = None  # a failed write leaves the LoRA slot empty, not stale
            self._write_adapter(lora_slot, adapter.weights)
            self._lora_slot_uid[lora_slot] = adapter.uid
            self.stats.device_load_seconds += time.perf_counter() - t0
            self.stats.device_loads += 1
        self._pins[lora_slot] += 1
        self._lora_slot_order.move_to_end(lora_slot)
        return lora_slot

    def release(self, lora_slot: int) -> None:
        """A request that pinned `lora_slot` no longer runs there."""
        if self._pins[lora_slot] <= 0:
            raise ValueError(f"LoRA slot {lora_slot} is not pinned")
        self._pins[lora_slot] -= 1

    @property
    def num_resident(self) -> int:
        """Adapters in LoRA slots."""
        return sum(uid is not None for uid in self._lora_slot_uid)

    @property
    def num_pinned(self) -> int:
        """Pins held by running requests (zero when nothing runs)."""
        return sum(self._pins)
