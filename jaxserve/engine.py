"""The engine: one step loop owning the scheduler, the KV manager and the model runner.

`step()` runs one iteration of one of two loops. Both schedule an iteration, launch it on the device
without waiting (`_launch`), and read an iteration's sampled tokens (`_read`): write each over its
placeholder, apply every stop rule (`_update`, the one place), detokenize, free finished sequences.

- The synchronous loop (`async_scheduling=False`) reads the iteration it launched.
- The overlapped loop (the default) launches iteration N+1 and then reads N while N+1 runs: the host's
  scheduling and output processing hide behind the device's work, and N's tokens feed N+1 on the device.

Three kinds of iteration change what the overlapped loop may overlap:

- Speculative decoding (`speculative_config`): a `Proposer` drafts from a request's known tokens, and a
  verified decode's accepted count decides where its next step starts. So while the proposer may draft (few
  running, a draft length above 0 chosen from each step's time, `_observe`) the iteration in flight is read
  before scheduling, and one that verifies drafts is read at once. Greedy output is the same either way.
- Multi-step decode (`num_scheduler_steps` K > 1, the scheduler's `DecodeLoop`): an iteration of
  unconstrained decodes runs up to K steps in one device program and is read at once, like a verify step
  (`SchedulerOutput.samples_several`): the host's work is paid once per K tokens instead of overlapped.
- Structured output: a constrained request's next mask depends on its last token. The next iteration's
  model step is dispatched first, then the iteration in flight is read, then the masks are written and the
  sampler dispatched (`ModelRunner.run_sampler`; a multi-host leader mirrors the two, so it does the same).

Not thread-safe: the async wrapper (`jaxserve.async_engine`) calls it from its own thread only.

Embeddings (`SamplingParams.pooling`) are prefilled like any prompt, pooling final hidden states (`output_processor`).

Fault isolation: an exception while preparing or post-processing (`output_processor`) one request's
part of an iteration fails that request alone; only a failure of the device iteration propagates.
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
from jaxserve.config_resolution import resolve
from jaxserve.dtype_choice import load_dtype, weights_dtype
from jaxserve.engine_client import DuplicateRequestError, UnknownAdapterError, encode_prompt
from jaxserve.engine_core_ops import EngineCoreOps
from jaxserve.engine_snapshot import EngineSnapshot, ReplicaLoad
from jaxserve.image_prompt import MultimodalPrompt, PromptImage
from jaxserve.kv import CopyStage, build_kv_manager
from jaxserve.kv.tier_stats import TierStats
from jaxserve.kv_tiers import build_lower_tier
from jaxserve.lora.manager import AdapterRef, LoraManager
from jaxserve.output_processor import OutputProcessor, StepStats
from jaxserve.outputs import Delta, FinishReason
from jaxserve.pooling import PromptPooling
from jaxserve.quantization_choice import weights_quantization
from jaxserve.request import Request, RequestStatus
from jaxserve.runner import ModelRunner, StepHandle, checkpoint_shardings, read_hidden
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK
from jaxserve.runner.prepared_step import PreparedStep
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.scheduler.output import SchedulerOutput
from jaxserve.speculative.draft_loading import load_model_proposer
from jaxserve.speculative.proposer import build_proposer
from jaxserve.structured import GrammarCompiler
from jaxserve.text_stream import TextStream
from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine(EngineCoreOps):
    """One engine replica (`jaxserve.engine_core.EngineCore`): the request loop here, its other
    operations (placement answers, pins, KV blocks, LoRA host copies) in `EngineCoreOps`."""

    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, config: EngineConfig | None = None, mesh: Any = None):
        asked = config or EngineConfig()  # the user's flags (a draft model's "auto" is chosen for its own file)
        config = dataclasses.replace(asked, quantization=weights_quantization(asked, model))
        dtype = weights_dtype(config)  # "auto": this machine's choice
        if isinstance(model, LoadedModel):
            loaded = model
        else:  # restored straight into this replica's shards
            loaded = load_model(
                model,
                dtype=load_dtype(config.quantization, dtype),
                shardings=checkpoint_shardings(config, mesh),
                gguf_blocks=config.quantization == "gguf",
            )
        self.model_config = loaded.config
        self.model_name = model if isinstance(model, str) else "custom"
        self.tokenizer = Tokenizer(loaded.tokenizer_bundle)
        # Everything derived (context, KV blocks, buckets, ...) once, before anything is built.
        self.config = ec = resolve(config, loaded.config, dtype)
        self.vision = loaded.vision and loaded.vision.config  # a vision-language model's (None: text only)
        self.runner = ModelRunner(loaded.config, loaded.params, ec, mesh, loaded.vision)
        self.lower_tier = build_lower_tier(self.runner, self.model_name)  # disk, pool, both or None
        self.kv = build_kv_manager(
            ec.num_blocks,
            ec.block_size,
            watermark_blocks=ec.watermark_blocks,
            enable_prefix_cache=ec.enable_prefix_caching,
            num_host_slots=ec.num_host_slots,
            lower_tier=self.lower_tier,
            write_through_hits=ec.kv_disk_write_through_hits,
            kv_events=ec.kv_events and ec.enable_prefix_caching,
            num_state_slots=ec.num_state_slots,
            num_state_snapshots=ec.num_state_snapshots,
            sliding_window=ec.kv_window,
        )
        self.lora = (
            None
            if not ec.enable_lora
            else LoraManager(
                loaded.config, ec.max_loras, ec.max_cpu_loras, ec.max_lora_rank, self.runner.write_lora_slot
            )
        )
        # Speculative decoding (None: off); a draft model is loaded like the target, onto its mesh; an MTP
        # layer is the target's own (its hidden states read off every step).
        self.proposer = build_proposer(
            ec.speculative_config,
            ec.max_model_len,
            lambda spec: load_model_proposer(spec, asked, ec, loaded, self.runner),
        )
        self.runner.keep_hidden = self.proposer is not None and self.proposer.wants_hidden
        encoded = self.runner.vision.cache if self.runner.vision is not None else frozenset()
        self.scheduler = Scheduler(ec, self.kv, self.lora, self.proposer, encoded_images=encoded)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCompiler(
            loaded.tokenizer_bundle.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self._groups: dict[str, list[Request]] = {}  # the live requests: id -> its sequences
        self._rng = random.Random(ec.seed)
        self._in_flight: StepHandle | None = None  # launched, output not read (async scheduling)
        self.stats = StepStats()
        self.outputs = OutputProcessor(self.scheduler, self._groups, self.stats, ec.max_model_len)

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations + (self.proposer.num_compilations if self.proposer is not None else 0)

    def warm_up(self) -> float:
        t0 = time.perf_counter()
        if self.proposer is not None:
            self.proposer.warm_up()
        self.runner.warm_up()
        seconds = time.perf_counter() - t0
        logger.info("compiled %s in %.1f s", self.runner.bucket_summary(), seconds)
        return seconds

    # ----- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int] | MultimodalPrompt, params: SamplingParams
    ) -> list[Request]:
        """Queue a request; `n > 1` becomes n sequences sharing the prompt's blocks."""
        images = prompt.images if isinstance(prompt, MultimodalPrompt) else ()
        return self.add_prompt_ids(request_id, self.encode_prompt(prompt), params, images)

    def add_prompt_ids(
        self, request_id: str, ids: list[int], params: SamplingParams, images: tuple[PromptImage, ...] = ()
    ) -> list[Request]:
        """`add_request` for token ids that `encode_prompt` returned (they are not checked again),
        and the rows of their images (`jaxserve.image_prompt`)."""
        if request_id in self._groups:
            raise DuplicateRequestError(request_id)
        if images and self.vision is None:
            raise ValueError("this model takes no images (it has no vision tower)")
        params.check_vocabulary(self.model_config.vocab_size)
        adapter = self._adapter(params.lora)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        grammars = [None] * params.n if params.guided is None else self.grammars.states(params.guided, params.n)
        group = [  # all built before any is registered: a failure leaves nothing behind
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}-{i}",
                prompt_token_ids=ids,
                params=params,
                seed=(base_seed + i) % (1 << 31),
                eos_token_ids=self.eos_token_ids,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                grammar=grammars[i],
                text=TextStream(request_id, i, params, ids, self.tokenizer),
                pooling=PromptPooling(params.pooling) if params.pooling is not None else None,
                adapter=adapter,
                images=images,
            )
            for i in range(params.n)
        ]
        self._groups[request_id] = group
        for req in group:
            self.scheduler.add_request(req)
        return group

    def _adapter(self, name: str | None) -> AdapterRef | None:
        if name is None:
            return None
        if self.lora is None:
            raise UnknownAdapterError(f"the model {name!r} does not exist (LoRA adapters are not enabled)")
        try:
            return self.lora.resolve(name)
        except KeyError:
            raise UnknownAdapterError(f"the model {name!r} does not exist") from None

    def encode_prompt(self, prompt: str | list[int] | MultimodalPrompt) -> list[int]:
        """Token ids of a prompt, or ValueError when it cannot be served (see `engine_client.encode_prompt`)."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.config.max_model_len)

    def abort(self, request_id: str) -> list[Delta]:
        """Stop a request now; its blocks are freed and final deltas returned."""
        deltas = []
        for req in self._groups.get(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, FinishReason.ABORT)
                deltas.append(self.outputs.final_delta(req, FinishReason.ABORT))
        self.outputs.forget_if_finished(request_id)
        return deltas

    # ----- state the serving layer reads ----------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        sched, kv = self.scheduler, self.kv
        usage, cache = kv.usage(), kv.stats
        preempted_waiting = sum(1 for r in sched.waiting if r.status is RequestStatus.PREEMPTED)
        return EngineSnapshot(
            running=len(sched.running),
            waiting=len(sched.waiting),
            swapped=len(sched.swapped),
            preempted=preempted_waiting + len(sched.swapped),
            has_unfinished=self.has_unfinished_requests(),
            kv_requests=kv.num_live_handles,
            kv=usage,
            prefix_query_tokens=cache.query_tokens,
            prefix_hit_tokens=cache.hit_tokens + cache.host_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_compilations=self.num_compilations,
            num_steps=self.stats.num_steps,
            prompt_tokens_computed=self.stats.prompt_tokens_computed,
            generated_tokens=self.stats.generated_tokens,
            replicas=(ReplicaLoad(len(sched.running), len(sched.waiting), usage.used, usage.num_blocks),),
            tiers=TierStats.of(kv),
            **self.stats.speculative_counts(self.config.speculative_config, self.proposer),
            expert_tokens=tuple(int(n) for n in self.runner.totals.expert_tokens),
            expert_load=tuple(int(n) for n in self.runner.totals.last_expert_load),
            **self._lora_counts(),
            pipeline_stage_busy_ticks=tuple(int(n) for n in self.runner.totals.pipeline_ticks.busy),
            pipeline_ticks=self.runner.totals.pipeline_ticks.ticks,
        )

    def _lora_counts(self) -> dict[str, Any]:
        if self.lora is None:
            return {}
        stats = self.lora.stats
        return dict(
            lora_resident=self.lora.num_resident,
            lora_disk_loads=stats.disk_loads,
            lora_device_loads=stats.device_loads,
            lora_requests=tuple(sorted(stats.requests.items())),
        )

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet. (An iteration may still be in flight when the last one ends;
        it holds only finished requests then, and the next step reads and drops it.)"""
        return bool(self._groups)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._groups

    def close(self) -> None:
        """A clean shutdown's work for the tier below the host tier (disk or pool), so the next engine
        on the directory or pool finds the prefix cache: read the iteration in flight (its full blocks
        enter the cache), write the cached blocks (device and host tier) the tier lacks, most recently
        used first within its budget, wait for the writes and stop the tier's threads. Requests still
        unfinished are not run further; their cached blocks are written too. Idempotent; nothing to do
        without such a tier."""
        if self.lower_tier is None or self.lower_tier.closed:
            return
        flushed = 0
        try:
            if self._in_flight is not None:
                self._read(self._take_in_flight())
            flushed = self.kv.flush_to_disk()
            # The writes the last step planned, then the flush's, a chunk at a time with the writer
            # caught up after each: the device holds one chunk of gathered blocks, not the cache twice.
            for stage in self.kv.take_copies():
                for i in range(0, len(stage), BLOCK_MOVE_CHUNK):
                    part = slice(i, i + BLOCK_MOVE_CHUNK)
                    self.runner.move_blocks([CopyStage(stage.kind, stage.src[part], stage.dst[part])])
                    self.lower_tier.flush()
        except Exception:  # noqa: BLE001 - e.g. a failed device: keep what is on disk, stop cleanly
            logger.exception("writing the prefix cache to the KV tier below the host at shutdown failed")
        self.lower_tier.close()
        stored = ", ".join(f"{t.kind} {t.num_blocks} ({t.num_bytes / 1e6:.1f} MB)" for t in self.lower_tier.tiers)
        logger.info(
            "KV %s tier closed: %d cached blocks written at shutdown; blocks stored: %s",
            self.lower_tier.kind,
            flushed,
            stored,
        )

    # ----- the loop -------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        t0 = time.perf_counter()
        deltas = self._overlapped_step() if self.config.async_scheduling else self._synchronous_step()
        self.stats.step_time += time.perf_counter() - t0
        return deltas

    def _synchronous_step(self) -> list[Delta]:
        """Schedule an iteration, launch it, read it."""
        deltas: list[Delta] = []
        t0 = time.perf_counter()
        handle = self._launch(sched := self.scheduler.schedule(), deltas)
        if handle is not None:
            deltas += self._read(handle)
        self._observe(sched, t0)
        return deltas

    def _overlapped_step(self) -> list[Delta]:
        """Launch iteration N+1, then read iteration N (see the module docstring for when N is
        read first, and when N+1 is read at once)."""
        deltas: list[Delta] = []
        if (
            self._in_flight is not None
            and self.proposer is not None
            and self.proposer.may_propose(len(self.scheduler.running))
        ):
            deltas += self._read(self._take_in_flight())
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        handle = self._launch(sched, deltas)
        if sched.samples_several:  # its next iteration depends on what it kept
            for launched in (self._take_in_flight(), handle):
                if launched is not None:
                    deltas += self._read(launched)
        else:
            previous, self._in_flight = self._in_flight, handle
            if previous is not None:
                deltas += self._read(previous)
        self._observe(sched, t0)
        return deltas

    def _observe(self, sched: SchedulerOutput, t0: float) -> None:
        """The proposer's draft length learns the step's time since `t0` and the acceptance counts."""
        if self.proposer is not None:
            counts = (self.stats.position_drafts, self.stats.position_accepted)
            self.proposer.draft_length.observe(sched, time.perf_counter() - t0, self.proposer.draft_seconds, counts)

    def _launch(self, sched: SchedulerOutput, deltas: list[Delta]) -> StepHandle | None:
        """Launch a scheduled iteration (None for an empty one). A launch that waits for grammar
        masks gets them once the iteration in flight is read (its deltas join `deltas`)."""
        if sched.is_empty:
            if self._in_flight is None and self.kv.loads.pending:
                self.kv.loads.submit()
                self.lower_tier.wait(0.01)  # only requests loading from disk or pool: do not spin
            self.kv.loads.submit()
            return None
        prepared = self._prepare(sched, deltas)
        # Marked launched first: the read of the step in flight below sees this step's placeholders
        # (nothing is dispatched in between, so its writes still come first).
        self.scheduler.on_step_launched(sched)
        handle = self.runner.run_model(sched, prepared)
        if handle.awaits_masks and self._in_flight is not None:  # the masks follow its tokens
            deltas += self._read(self._take_in_flight())
        self.runner.run_sampler(handle)
        for pooled in prepared.pooled:  # a recompute launched later does not pool these again
            pooled.request.pooling.on_launched(pooled.positions)
        self.kv.loads.submit()  # after the launch: the copies that read their host slots have run
        self.stats.count_launch(sched, prepared, self.runner.last_prepare_time + self.runner.last_launch_time)
        return handle

    def _take_in_flight(self) -> StepHandle | None:
        handle, self._in_flight = self._in_flight, None
        return handle

    def _prepare(self, sched: SchedulerOutput, deltas: list[Delta]) -> PreparedStep:
        """The iteration's host arrays. If building them raises, each chunk is tried alone: the
        requests whose own inputs fail are failed and dropped, and the rest is built again."""
        try:
            return self.runner.prepare(sched)
        except Exception:  # noqa: BLE001 - find whose inputs failed
            pass
        for field in ("prefills", "decodes"):
            kept = []
            for chunk in getattr(sched, field):
                try:
                    self.runner.prepare(SchedulerOutput(**{field: [chunk]}))
                    kept.append(chunk)
                except Exception as e:  # noqa: BLE001 - this request's fault
                    deltas += self.outputs.fail(chunk.request, e)
            setattr(sched, field, kept)
        return self.runner.prepare(sched)

    def _read(self, handle: StepHandle) -> list[Delta]:
        """Read an iteration's sampled tokens and update every request it sampled for."""
        results = self.runner.fetch(handle)
        if self.runner.keep_hidden:  # before the tokens land: a request they finish is released
            self.proposer.take_hidden(read_hidden(handle, results))
        self.stats.model_time += self.runner.last_fetch_time
        self.stats.overlapped_reads += handle.launches_before_fetch > handle.launch_index
        return self.outputs.land(handle, results)
