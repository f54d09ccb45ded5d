"""The engine: one step loop owning the scheduler, the KV manager and the model runner.

Each `step()`: schedule -> run the model -> advance the scheduler -> append sampled tokens,
check stops, detokenize -> free finished sequences -> return the deltas. Not thread-safe: the
async wrapper (`jaxserve.async_engine`) calls it from its own thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any

from checkpoints.loaded import LoadedModel
from checkpoints.registry import DEFAULT_MODEL, load_model
from jaxserve.config import EngineConfig
from jaxserve.kv import KVCacheManager
from jaxserve.output_processor import SequenceStream
from jaxserve.outputs import Delta, Usage
from jaxserve.request import FinishReason, Request
from jaxserve.runner import ModelRunner, checkpoint_shardings
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within max_model_len."""


@dataclasses.dataclass
class StepStats:
    num_steps: int = 0
    step_time: float = 0.0  # all of step(), wall clock
    model_time: float = 0.0  # runner.execute (arrays, device step, sampling, transfer back)
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0


class LLMEngine:
    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, config: EngineConfig | None = None, mesh: Any = None):
        self.config = config or EngineConfig()
        ec = self.config
        if isinstance(model, LoadedModel):
            loaded = model
        else:  # restored straight into this replica's shards
            loaded = load_model(model, dtype=ec.dtype, shardings=checkpoint_shardings(ec, mesh))
        self.model_config = loaded.config
        self.model_name = model if isinstance(model, str) else "custom"
        self.tokenizer = Tokenizer(loaded.tokenizer_bundle)
        ec.max_model_len = min(ec.max_model_len, self.model_config.max_position_embeddings)
        self.runner = ModelRunner(loaded.config, loaded.params, ec, mesh)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            ec.block_size,
            watermark_blocks=ec.watermark_blocks,
            enable_prefix_cache=ec.enable_prefix_caching,
            num_host_slots=ec.swap_space_blocks,
        )
        # A lone request must always fit the pool, or it could be preempted forever.
        capacity = (self.kv.pool.num_usable - self.kv.watermark_blocks) * ec.block_size
        if ec.max_model_len > capacity:
            logger.warning("max_model_len %d exceeds the KV cache (%d tokens); lowering it", ec.max_model_len, capacity)
            ec.max_model_len = capacity
        self.scheduler = Scheduler(ec, self.kv)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._streams: dict[Request, SequenceStream] = {}
        self._groups: dict[str, list[Request]] = {}
        self._rng = random.Random(ec.seed)
        self.stats = StepStats()

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def warm_up(self) -> float:
        seconds = self.runner.warm_up()
        logger.info("compiled %s in %.1f s", self.runner.bucket_summary(), seconds)
        return seconds

    # ----- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> list[Request]:
        """Queue a request; `n > 1` becomes n sequences sharing the prompt's blocks."""
        if request_id in self._groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        ids = self.encode_prompt(prompt)
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        group = []
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}-{i}",
                prompt_token_ids=ids,
                params=params,
                seed=(base_seed + i) % (1 << 31),
                eos_token_ids=self.eos_token_ids,
            )
            self._streams[req] = SequenceStream(request_id, req, i, self.tokenizer, self.config.max_model_len)
            group.append(req)
        self._groups[request_id] = group
        for req in group:
            self.scheduler.add_request(req)
        return group

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, or ValueError when it cannot be served. Text is a completion
        prompt: it gets what the tokenizer adds (a BOS for Llama 2 / Mistral), as in vLLM; a
        rendered chat, whose template writes its own BOS, comes as ids."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                f"including at least one generated token"
            )
        return ids

    def abort(self, request_id: str) -> list[Delta]:
        """Stop a request now; its blocks are freed and final deltas returned."""
        deltas = []
        for req in self._groups.get(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, FinishReason.ABORT)
                deltas.append(self._final_delta(req, FinishReason.ABORT))
        self._forget_if_finished(request_id)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._groups

    # ----- the loop -------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        results = self.runner.execute(sched)
        self.stats.model_time += self.runner.last_step_time
        self.scheduler.on_step_done(sched)
        deltas = []
        finished_groups = set()
        for chunk, sampled in results:
            req = chunk.request
            if req.is_finished:  # aborted while its step was running
                continue
            stream = self._streams[req]
            reason = stream.add_token(sampled)
            self.stats.generated_tokens += 1
            if reason is not None:
                self.scheduler.finish(req, reason)
                deltas.append(self._final_delta(req, reason))
                finished_groups.add(stream.group_id)
            else:
                delta = stream.take_delta(None, None)
                if delta is not None:
                    deltas.append(delta)
        self.stats.prompt_tokens_computed += sum(c.num_new_tokens for c in sched.prefills)
        for group_id in finished_groups:
            self._forget_if_finished(group_id)
        self.stats.num_steps += 1
        self.stats.step_time += time.perf_counter() - t0
        return deltas

    def _final_delta(self, req: Request, reason: FinishReason) -> Delta:
        usage = Usage(req.num_prompt_tokens, len(req.output_token_ids), req.num_cached_prompt_tokens)
        return self._streams[req].take_delta(reason, usage)

    def _forget_if_finished(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is not None and all(r.is_finished for r in group):
            del self._groups[request_id]
            for req in group:
                del self._streams[req]
