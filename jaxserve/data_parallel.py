"""Data parallelism: N engine replicas, each on its own 1 x tp sub-mesh, behind one engine.

`DataParallelEngine` has the methods of `LLMEngine` that the offline `LLM` uses (`add_request`,
`step`, `abort`, `has_unfinished_requests`, `is_active`, `encode_prompt`, `warm_up`, `tokenizer`),
so it stands in for one; `make_engine` returns one or the other from
`EngineConfig.data_parallel_size`. The async engine (and so the server) always drives a
`DataParallelEngine`, of one replica when there is no data parallelism, so session placement has
one code path.

Placement is cache-aware (`jaxserve.routing`). A request that names a session goes where the
session's earlier turns went (their KV is cached there). Load is the number of unfinished
sequences a replica holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

from checkpoints.loaded import LoadedModel
from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.dtype_choice import load_dtype, weights_dtype
from jaxserve.engine import LLMEngine, StepStats
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.kv import Pin
from jaxserve.lora.peft import LoraWeights
from jaxserve.outputs import Delta
from jaxserve.request import Request
from jaxserve.routing import RoutingPolicy, choose_replica
from jaxserve.sampling_params import SamplingParams
from sharding.mesh import make_mesh, replica_meshes


class DataParallelEngine:
    """Engine replicas behind one engine. Like `LLMEngine`, not thread-safe: one
    thread drives it; `step` runs the replicas' steps concurrently on a private pool."""

    def __init__(self, engines: Sequence[LLMEngine], policy: RoutingPolicy | None = None):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.replicas = list(engines)
        self.policy = policy or RoutingPolicy()
        first = self.replicas[0]
        self.config = first.config
        self.model_config = first.model_config
        self.model_name = first.model_name
        self.tokenizer = first.tokenizer
        self._sessions: dict[Hashable, int] = {}
        self._pool = None
        if len(self.replicas) > 1:
            self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="dp-replica")

    @classmethod
    def build(
        cls,
        model: str | LoadedModel,
        config: EngineConfig,
        devices: list | None = None,
        policy: RoutingPolicy | None = None,
    ) -> DataParallelEngine:
        """`config.data_parallel_size` replicas over the first dp x pp x ep x tp devices; the
        checkpoint is read once and each replica places its own shards."""
        config = dataclasses.replace(config, dtype=weights_dtype(config))  # "auto" chosen once for all replicas
        mesh = make_mesh(
            config.tensor_parallel_size,
            config.data_parallel_size,
            devices,
            config.expert_parallel_size,
            config.pipeline_parallel_size,
        )
        loaded = (
            model
            if isinstance(model, LoadedModel)
            else load_model(
                model, dtype=load_dtype(config.quantization, config.dtype), gguf_blocks=config.quantization == "gguf"
            )
        )
        engines = [LLMEngine(loaded, config, sub_mesh) for sub_mesh in replica_meshes(mesh)]
        router = cls(engines, policy)
        if isinstance(model, str):
            for engine in engines:
                engine.model_name = model
            router.model_name = model
        return router

    # ----- routing ------------------------------------------------------------------------

    @property
    def max_num_seqs(self) -> int:
        """Sequences all replicas can run at once."""
        return self.config.max_num_seqs * len(self.replicas)

    def loads(self) -> list[int]:
        return [e.scheduler.num_unfinished for e in self.replicas]

    def route(self, prompt_ids: Sequence[int], session_id: Hashable | None = None, lora: str | None = None) -> int:
        """The replica a prompt would go to now (sessions stick to their first replica). A LoRA
        request (`lora`, its adapter's name) counts only its adapter's cached KV and prefers a
        replica that holds the adapter in a device slot."""
        if session_id is not None and session_id in self._sessions:
            return self._sessions[session_id]
        if len(self.replicas) == 1:
            return 0
        if lora is None:
            matches = [e.kv.match_prefix(prompt_ids).num_tokens for e in self.replicas]
            return choose_replica(matches, self.loads(), len(prompt_ids), self.policy)
        matches, resident = [], []
        for e in self.replicas:
            ids = None if e.lora is None else e.lora.cache_ids(lora, list(prompt_ids))
            matches.append(0 if ids is None else e.kv.match_prefix(ids).num_tokens)
            resident.append(e.lora is not None and e.lora.is_resident(lora))
        return choose_replica(matches, self.loads(), len(prompt_ids), self.policy, resident)

    def session_replica(self, session_id: Hashable, prompt_ids: Sequence[int], lora: str | None = None) -> LLMEngine:
        """The replica that holds a session's KV (routing `prompt_ids` if it has none yet)."""
        index = self._sessions.setdefault(session_id, self.route(prompt_ids, session_id, lora))
        return self.replicas[index]

    def end_session(self, session_id: Hashable, pin: Pin | None = None) -> None:
        """Forget a session's replica (its next request is routed afresh) and release its pin."""
        self._sessions.pop(session_id, None)
        if pin is not None:
            self.unpin(pin)

    def has_session(self, session_id: Hashable) -> bool:
        return session_id in self._sessions

    def pin_history(
        self,
        session_id: Hashable,
        owner: str,
        token_ids: list[int],
        old: Pin | None,
        others: list[Pin],
        lora: str | None = None,
    ) -> tuple[Pin | None, list[Pin]]:
        """Pin a session's history on the replica that holds the session (routing it there first):
        see `Leases.pin_within_budget`. A session of LoRA adapter `lora` pins the blocks its
        adapter computed (keyed as `LoraManager.cache_ids` says); when the replica has no number
        for the adapter's bytes any more (it was unloaded), nothing is pinned and `old` released."""
        replica = self.session_replica(session_id, token_ids, lora)
        ids = (
            token_ids
            if lora is None or not token_ids
            else (None if replica.lora is None else replica.lora.cache_ids(lora, token_ids))
        )
        if ids is None:
            if old is not None and old.active and replica.kv.leases.holds_pin(old):
                replica.kv.leases.unpin(old)
                return None, [old]
            return None, []
        return replica.kv.leases.pin_within_budget(owner, ids, old, others)

    def unpin(self, pin: Pin) -> None:
        """Release a pin (on the replica that holds it; nothing if none does)."""
        for engine in self.replicas:
            leases = engine.kv.leases
            if pin.active and leases.holds_pin(pin):
                leases.unpin(pin)

    def set_pin_budget(self, blocks_per_owner: int) -> None:
        for engine in self.replicas:
            engine.kv.leases.budget_per_owner = blocks_per_owner

    def read_lora(self, path: str) -> LoraWeights:
        """An adapter read from disk (ValueError if it cannot be served): safe to call off the
        engine thread; `add_lora` and `keep_lora` take the result."""
        return self.replicas[0].require_lora().read(path)

    def missing_lora_host_copy(self, name: str) -> str | None:
        """The directory to read for a request of adapter `name` when some replica has no host
        copy of it (a plain dict read: safe off the engine thread, at worst a stale answer)."""
        for engine in self.replicas:
            path = None if engine.lora is None else engine.lora.missing_host_copy(name)
            if path is not None:
                return path
        return None

    def keep_lora(self, name: str, path: str, weights: LoraWeights) -> None:
        """Hold an adapter read by `read_lora` as `name`'s host copy on every replica."""
        for engine in self.replicas:
            engine.require_lora().keep(name, path, weights)

    def add_lora(self, name: str, path: str, weights: LoraWeights | None = None) -> None:
        """Serve a LoRA adapter on every replica (none changed when it cannot be served), with
        `weights` from `read_lora(path)` (read here when None)."""
        added = []
        try:
            if weights is None:
                weights = self.read_lora(path)
            for engine in self.replicas:
                engine.add_lora(name, path, weights)
                added.append(engine)
        except ValueError:
            for engine in added:
                engine.remove_lora(name)
            raise

    def remove_lora(self, name: str) -> None:
        for engine in self.replicas:
            engine.remove_lora(name)

    def lora_adapters(self) -> dict[str, str]:
        return self.replicas[0].lora_adapters()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.total([e.snapshot() for e in self.replicas])

    def bucket_summary(self) -> str:
        """The shape buckets every replica compiles."""
        return self.replicas[0].runner.bucket_summary()

    @property
    def lone_replica(self) -> LLMEngine:
        """The replica of a one-replica engine: what a multi-host job mirrors to its followers,
        and what a worker's KV transfers read and write."""
        if len(self.replicas) != 1:
            raise ValueError("multi-host jobs and KV transfers run one engine replica (no --data-parallel-size)")
        return self.replicas[0]

    # ----- the engine interface -----------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> list[Request]:
        if self.is_active(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        ids = self.encode_prompt(prompt)
        index = self.route(ids, session_id, params.lora)
        group = self.replicas[index].add_prompt_ids(request_id, ids, params)
        if session_id is not None:
            self._sessions[session_id] = index
        return group

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.replicas[0].encode_prompt(prompt)

    def step(self) -> list[Delta]:
        busy = [e for e in self.replicas if e.has_unfinished_requests()]
        if len(busy) <= 1:
            per_replica = [e.step() for e in busy]
        else:
            per_replica = list(self._pool.map(LLMEngine.step, busy))
        return [d for replica_deltas in per_replica for d in replica_deltas]

    def abort(self, request_id: str) -> list[Delta]:
        return [d for e in self.replicas if e.is_active(request_id) for d in e.abort(request_id)]

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.replicas)

    def is_active(self, request_id: str) -> bool:
        return any(e.is_active(request_id) for e in self.replicas)

    def warm_up(self) -> float:
        return sum(e.warm_up() for e in self.replicas)

    @property
    def num_compilations(self) -> int:
        return sum(e.num_compilations for e in self.replicas)

    @property
    def stats(self) -> StepStats:
        """The replicas' step statistics, summed (times are summed too: replica-seconds)."""
        fields = dataclasses.fields(StepStats)
        return StepStats(*(sum(getattr(e.stats, f.name) for e in self.replicas) for f in fields))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for engine in self.replicas:
            engine.close()


def make_engine(
    model: str | LoadedModel, config: EngineConfig, devices: list | None = None
) -> LLMEngine | DataParallelEngine:
    """One engine, or a router over `config.data_parallel_size` replicas, over the first of
    `devices` (default: every device of the job)."""
    if config.data_parallel_size > 1:
        return DataParallelEngine.build(model, config, devices)
    mesh = (
        None
        if devices is None
        else make_mesh(
            config.tensor_parallel_size, 1, devices, config.expert_parallel_size, config.pipeline_parallel_size
        )
    )
    return LLMEngine(model, config, mesh)
