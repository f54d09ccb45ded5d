"""`EncoderEngine`: an engine replica that serves an encoder embedding model.

It stands where an `LLMEngine` stands (the async engine's loop drives its `step()` through the
data-parallel engine), so embedding requests arrive, wait, batch and finish like any other:
each step takes waiting inputs (`EncoderBatcher`: whole inputs, padded to a compiled
(rows, tokens) bucket), runs the encoder once, and ends each input with its pooled embedding
(`jaxserve.pooling`). Nothing is generated and no KV cache exists, so the KV, session-pin and
LoRA operations of a decoder replica are refused with a ValueError (a 400 at the server).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from checkpoints.encoders import EncoderConfig, load_encoder
from jaxserve.config import EngineConfig
from jaxserve.encoder.batcher import EncoderBatcher, EncoderBuckets, EncoderRequest
from jaxserve.encoder.runner import EncoderRunner
from jaxserve.engine_client import DuplicateRequestError
from jaxserve.engine_snapshot import EngineSnapshot, KVUsage, ReplicaLoad
from jaxserve.image_prompt import PromptImage
from jaxserve.output_processor import StepStats
from jaxserve.outputs import Delta, FinishReason, Usage
from jaxserve.pooling import PromptPooling
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

NO_KV = "an encoder embedding model has no KV cache, sessions or LoRA adapters"


def _final(request: EncoderRequest, reason: FinishReason, embedding: np.ndarray | None = None) -> Delta:
    usage = Usage(len(request.token_ids), 0)
    return Delta(request.request_id, 0, "", [], None, reason.value, usage, embedding=embedding)


class EncoderEngine:
    """One replica serving an encoder (`checkpoints.encoders`). Not thread-safe: the engine
    thread calls it."""

    lower_tier = None  # no KV, so no tier below it

    def __init__(self, model: str, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        parallel = (config.tensor_parallel_size, config.data_parallel_size, config.pipeline_parallel_size)
        if parallel != (1, 1, 1):
            raise ValueError("an encoder embedding model runs on one device (no tensor, data or pipeline parallelism)")
        loaded = load_encoder(model)
        self.model_config: EncoderConfig = loaded.config
        self.model_name = model
        self.tokenizer = Tokenizer(loaded.tokenizer_bundle)
        max_len = min(loaded.config.max_len, config.max_model_len or loaded.config.max_len)
        self.config = dataclasses.replace(config, max_model_len=max_len)
        self.buckets = EncoderBuckets(max_len, config.max_num_seqs, max(config.max_num_batched_tokens, max_len))
        self.runner = EncoderRunner(loaded.config, loaded.params, self.buckets)
        self.batcher = EncoderBatcher(self.buckets)
        self.stats = StepStats()

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def warm_up(self) -> float:
        return self.runner.warm_up()

    def bucket_summary(self) -> str:
        return self.runner.bucket_summary()

    # ----- requests and steps ----------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        if not ids or min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise ValueError(f"an input must have 1 or more token ids in [0, {self.model_config.vocab_size})")
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"an input has {len(ids)} tokens; this model takes at most {self.config.max_model_len}")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[EncoderRequest]:
        """`jaxserve.LLM`'s entry: a text (or ids) to embed."""
        return self.add_prompt_ids(request_id, self.encode_prompt(prompt), params)

    def add_prompt_ids(
        self, request_id: str, ids: list[int], params: SamplingParams, images: tuple[PromptImage, ...] = ()
    ) -> list[EncoderRequest]:
        """Queue an input to embed. `params.pooling` says only that it is an embedding: the
        model's own pooling (`EncoderConfig.pooling`) picks its rows. It takes no images."""
        if images:
            raise ValueError(f"{self.model_name} is a text embedding model: it takes no images")
        if params.pooling is None:
            raise ValueError(f"{self.model_name} is an embedding model: it pools its inputs and generates no text")
        if self.is_active(request_id):
            raise DuplicateRequestError(request_id)
        request = EncoderRequest(request_id, ids, PromptPooling(self.model_config.pooling))
        self.batcher.add(request)
        return [request]

    def step(self) -> list[Delta]:
        t0 = time.perf_counter()
        batch, shape = self.batcher.next_batch()
        if not batch:
            return []
        sums = self.runner.run(batch, shape)
        deltas = []
        for request, total in zip(batch, sums):
            request.pooling.add(total, request.pooled_rows)
            deltas.append(_final(request, FinishReason.STOP, request.pooling.vector()))
        self.stats.num_steps += 1
        self.stats.prompt_tokens_computed += sum(len(r.token_ids) for r in batch)
        self.stats.step_time += time.perf_counter() - t0
        return deltas

    def abort(self, request_id: str) -> list[Delta]:
        return [_final(r, FinishReason.ABORT) for r in self.batcher.remove(request_id)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.batcher.waiting)

    def is_active(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.batcher.waiting)

    def snapshot(self) -> EngineSnapshot:
        waiting = len(self.batcher.waiting)
        return EngineSnapshot(
            running=0,
            waiting=waiting,
            swapped=0,
            preempted=0,
            has_unfinished=bool(waiting),
            kv_requests=0,
            kv=KVUsage(*[0] * len(dataclasses.fields(KVUsage))),
            prefix_query_tokens=0,
            prefix_hit_tokens=0,
            num_preemptions=0,
            num_compilations=self.num_compilations,
            num_steps=self.stats.num_steps,
            prompt_tokens_computed=self.stats.prompt_tokens_computed,
            generated_tokens=0,
            replicas=(ReplicaLoad(0, waiting, 0, 0),),
        )

    def close(self) -> None:
        """Nothing to flush: no disk tier, no KV."""

    # ----- placement (`jaxserve.placement.PlacementTarget`) -----------------------------------

    def load(self) -> int:
        return len(self.batcher.waiting)

    def prefix_match_length(self, token_ids: list[int], lora: str | None = None) -> int:
        return 0  # no prefix cache

    def adapter_resident(self, name: str) -> bool:
        return False

    # ----- what a decoder replica has and an encoder has not ---------------------------------

    def lora_adapters(self) -> dict[str, str]:
        return {}

    def lora_adapter_digests(self) -> dict[str, bytes]:
        return {}

    def kv_event_log(self) -> None:
        return None  # no prefix cache, so no KV events

    def set_pin_budget(self, blocks_per_owner: int) -> None:
        """Nothing is pinned: an encoder keeps no KV."""

    def refuse(self, *_args: object, **_kwargs: object) -> None:
        raise ValueError(NO_KV)

    pin_history = unpin = hold_prefix = release_hold = kv_block_layout = kv_handoff_fingerprint = refuse
    read_kv_blocks = write_kv_blocks = stage_kv_blocks = write_staged_kv_blocks = start_device_transfer = refuse
    read_lora = missing_lora_host_copy = keep_lora = add_lora = remove_lora = refuse
