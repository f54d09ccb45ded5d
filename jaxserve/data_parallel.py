"""Data parallelism: N engine replicas, each on its own 1 x tp sub-mesh, behind one engine.

`DataParallelEngine` has the methods of `LLMEngine` that the offline `LLM` uses (`add_request`,
`step`, `abort`, `has_unfinished_requests`, `is_active`, `encode_prompt`, `warm_up`, `tokenizer`),
so it stands in for one; `make_engine` returns one or the other from
`EngineConfig.data_parallel_size`. The async engine (and so the server) always drives a
`DataParallelEngine`, of one replica when there is no data parallelism, so session placement has
one code path.

It uses its replicas through `EngineCore` only. Placement is `jaxserve.placement.Placement`, the
router's too: a request that names a session goes where the session's earlier turns went (their
KV is cached there); others by the replicas' cached prefixes (each replica's own prefix cache
answers) and loads (unfinished sequences).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

from checkpoints.encoders import is_encoder_spec
from checkpoints.loaded import LoadedModel
from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.dtype_choice import load_dtype, weights_dtype
from jaxserve.encoder import EncoderEngine
from jaxserve.engine import LLMEngine, StepStats
from jaxserve.engine_client import DuplicateRequestError, Pin
from jaxserve.engine_core import EngineCore
from jaxserve.engine_snapshot import EngineSnapshot
from jaxserve.image_prompt import MultimodalPrompt, cache_token_ids
from jaxserve.outputs import Delta
from jaxserve.placement import Placement, PlacementPolicy
from jaxserve.quantization_choice import weights_quantization
from jaxserve.replica_adapters import ReplicaAdapters
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from sharding.mesh import make_mesh, replica_meshes


class DataParallelEngine:
    """Engine replicas behind one engine. Like `LLMEngine`, not thread-safe: one
    thread drives it; `step` runs the replicas' steps concurrently on a private pool."""

    def __init__(self, replicas: Sequence[EngineCore], policy: PlacementPolicy | None = None):
        self.placement: Placement[EngineCore] = Placement(replicas, policy or PlacementPolicy())
        self.replicas = self.placement.targets
        self.adapters = ReplicaAdapters(self.replicas)
        first = self.replicas[0]
        self.config = first.config
        self.model_config = first.model_config
        self.model_name = first.model_name
        self.tokenizer = first.tokenizer
        self.vision = getattr(first, "vision", None)  # a vision-language model's tower config (None: text only)
        self._pool = None
        if len(self.replicas) > 1:
            self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="dp-replica")

    @classmethod
    def build(
        cls,
        model: str | LoadedModel,
        config: EngineConfig,
        devices: list | None = None,
        policy: PlacementPolicy | None = None,
    ) -> DataParallelEngine:
        """`config.data_parallel_size` replicas over the first dp x pp x ep x tp devices; the
        checkpoint is read once and each replica places its own shards."""
        # "auto" chosen once for all replicas
        config = dataclasses.replace(
            config, dtype=weights_dtype(config), quantization=weights_quantization(config, model)
        )
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
        replicas = [LLMEngine(loaded, config, sub_mesh) for sub_mesh in replica_meshes(mesh)]
        engine = cls(replicas, policy)
        if isinstance(model, str):
            for replica in replicas:
                replica.model_name = model
            engine.model_name = model
        return engine

    # ----- placement and session pins ------------------------------------------------------

    @property
    def max_num_seqs(self) -> int:
        """Sequences all replicas can run at once."""
        return self.config.max_num_seqs * len(self.replicas)

    def loads(self) -> list[int]:
        return self.placement.loads()

    def route(self, prompt_ids: Sequence[int], session_id: Hashable | None = None, lora: str | None = None) -> int:
        """The index of the replica a prompt would go to now (sessions stick to their replica). A
        LoRA request (`lora`, its adapter's name) counts only its adapter's cached KV and prefers
        a replica that holds the adapter in a LoRA slot."""
        return self.replicas.index(self.placement.choose(prompt_ids, session_id, lora))

    def end_session(self, session_id: Hashable, pin: Pin | None = None) -> None:
        """Forget a session's replica (its next request is placed afresh) and release its pin."""
        self.placement.end_session(session_id)
        if pin is not None:
            self.unpin(pin)

    def pin_history(
        self,
        session_id: Hashable,
        owner: str,
        token_ids: list[int],
        old: Pin | None,
        others: list[Pin],
        lora: str | None = None,
    ) -> tuple[Pin | None, list[Pin]]:
        """Pin a session's history on the replica that holds the session (placing it there
        first): see `EngineCore.pin_history`."""
        replica = self.placement.place(token_ids, session_id, lora)
        return replica.pin_history(owner, token_ids, old, others, lora)

    def unpin(self, pin: Pin) -> None:
        """Release a pin (on the replica that holds it; nothing if none does)."""
        for replica in self.replicas:
            if replica.unpin(pin):
                return

    def set_pin_budget(self, blocks_per_owner: int) -> None:
        for replica in self.replicas:
            replica.set_pin_budget(blocks_per_owner)

    @property
    def lone_replica(self) -> EngineCore:
        """The replica of a one-replica engine: what a multi-host job mirrors to its followers,
        and what a worker's KV transfers read and write."""
        if len(self.replicas) != 1:
            raise ValueError("multi-host jobs and KV transfers run one engine replica (no --data-parallel-size)")
        return self.replicas[0]

    # ----- the engine interface -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams,
        session_id: Hashable | None = None,
    ) -> list[Request]:
        if self.is_active(request_id):
            raise DuplicateRequestError(request_id)
        ids = self.encode_prompt(prompt)
        images = prompt.images if isinstance(prompt, MultimodalPrompt) else ()
        # Placed as the replicas' caches key it: an image's rows salted by its digest.
        replica = self.placement.choose(cache_token_ids(ids, images), session_id, params.lora)
        group = replica.add_prompt_ids(request_id, ids, params, images)
        self.placement.stick(session_id, replica)
        return group

    def encode_prompt(self, prompt: str | list[int] | MultimodalPrompt) -> list[int]:
        return self.replicas[0].encode_prompt(prompt)

    def step(self) -> list[Delta]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        if len(busy) <= 1:
            per_replica = [r.step() for r in busy]
        else:
            per_replica = list(self._pool.map(lambda r: r.step(), busy))
        return [d for replica_deltas in per_replica for d in replica_deltas]

    def abort(self, request_id: str) -> list[Delta]:
        return [d for r in self.replicas if r.is_active(request_id) for d in r.abort(request_id)]

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def is_active(self, request_id: str) -> bool:
        return any(r.is_active(request_id) for r in self.replicas)

    def warm_up(self) -> float:
        return sum(r.warm_up() for r in self.replicas)

    def bucket_summary(self) -> str:
        """The shape buckets every replica compiles."""
        return self.replicas[0].bucket_summary()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.total([r.snapshot() for r in self.replicas])

    @property
    def num_compilations(self) -> int:
        return sum(r.num_compilations for r in self.replicas)

    @property
    def stats(self) -> StepStats:
        """The replicas' step statistics, summed (times are summed too: replica-seconds)."""
        return StepStats.total([r.stats for r in self.replicas])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for replica in self.replicas:
            replica.close()


def make_engine(
    model: str | LoadedModel, config: EngineConfig, devices: list | None = None
) -> LLMEngine | DataParallelEngine:
    """One engine, or a data-parallel engine over `config.data_parallel_size` replicas, over the
    first of `devices` (default: every device of the job)."""
    if isinstance(model, str) and is_encoder_spec(model):
        return EncoderEngine(model, config)  # one replica, its own compiled steps (no KV cache)
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
