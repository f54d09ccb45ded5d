"""The model runner: compiles the bucketed steps and runs a prepared iteration on the devices.

`warm_up()` compiles every bucket ahead of time (`lower().compile()`), and `num_compilations`
counts every compilation, so a test can prove that serving after warm-up compiles nothing.
An iteration is launched without waiting for the device (`launch`), and its sampled tokens are
read later (`fetch`); the next iteration may be launched in between, reading the tokens it
needs from this one's sampled buffer on the device. A decode step samples in its own program
(one dispatch); a prefill step, or a decode step with constrained rows (their masks are written
after it is dispatched), is followed by the sampler's program.

The KV cache is donated to every step and updated in place. Block moves run before the steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Generator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from checkpoints.digest import weights_digest
from checkpoints.quantize import GGUF, INT8, Q4, formats_of, quantize_head, quantize_params
from jaxserve.kv import CopyStage
from jaxserve.lora.peft import LoraWeights
from jaxserve.model import DecoderModel, KVCache
from jaxserve.model.experts import expert_backend
from jaxserve.model.layout import pack_kernels, panel_kernels, unstack_layers
from jaxserve.model.lora import LORA_MODULES
from jaxserve.outputs import SampledToken
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK, BlockMover
from jaxserve.runner.host_heap import keep_freed_blocks
from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.inputs import StepInputs
from jaxserve.runner.lora_slots import LoraSlots
from jaxserve.runner.pipeline_placement import pipeline_layers, plan_stages, stage_model_config, stage_params
from jaxserve.runner.placement import cast_params, enable_persistent_compilation_cache, plan_parallelism, runner_mesh
from jaxserve.runner.prepared_step import PreparedStep, Program, write_token_masks
from jaxserve.runner.programs import declare_programs
from jaxserve.runner.step_counters import PipelineTicks, StepCounters
from jaxserve.runner.step_functions import StepFunctions
from jaxserve.runner.step_handle import StepHandle, StepResults
from jaxserve.sampling_tensors import PenaltyCounts
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from kernels_pallas import cpu_matmul, default_attention_backend, get_attention_backend, kv_quant, shard_attention
from sharding.kv_heads import replicate_kv_heads
from sharding.rules import cache_sharding, layer_sharding, param_shardings, replicated

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: ModelConfig, params: Any, engine_config: ResolvedConfig, mesh: Mesh | None = None):
        if not isinstance(engine_config, ResolvedConfig):
            raise TypeError("ModelRunner takes a ResolvedConfig: jaxserve.config_resolution.resolve(config, model)")
        self.engine_config = engine_config
        self.weights_digest = weights_digest(params)  # of the checkpoint's arrays, before any layout here
        if jax.default_backend() == "cpu":
            keep_freed_blocks()  # each step's temporaries reuse the last one's pages (host_heap)
        if engine_config.compilation_cache_dir:
            enable_persistent_compilation_cache(engine_config.compilation_cache_dir)
        # Tensor parallel: heads split over "tp"; kv heads repeated where tp needs more of them,
        # so `self.config` (what the model and cache are built with) may have more kv heads.
        plan = plan_parallelism(config, engine_config)
        self.mesh = runner_mesh(engine_config, mesh)
        self.config = config = dataclasses.replace(config, num_kv_heads=plan.served_kv_heads)
        # Pipeline stages: the layers (weights and cache) in whole stages over "pp" (pipeline_placement).
        self.stages = plan_stages(config, engine_config)
        if self.stages is not None:
            logger.info("pipeline stages: %s", self.stages.describe())
            self.config = config = stage_model_config(config, self.stages)
        self.dtype = jnp.dtype(engine_config.dtype)  # of the weights
        self.attention_backend = engine_config.attention_backend or default_attention_backend()
        attention = shard_attention(get_attention_backend(self.attention_backend), self.mesh, "tp")
        # One CPU device with f32 or bf16 weights, the cpu backend and scanned layers: the layers'
        # matmuls read their layer of the stacked weights, stored in panels, in place, and the tied
        # head is a C++ kernel too (kernels_pallas/cpu_matmul.py).
        native_matmul = (
            self.attention_backend == "cpu"
            and self.dtype in cpu_matmul.WEIGHT_DTYPES
            and self.mesh.size == 1
            and not engine_config.unroll_layers
        )
        matmul = cpu_matmul.kernels() if native_matmul else None
        experts = expert_backend(config, self.mesh) if config.num_experts else None
        # Weight-only quantization: kernels quantized here (int8, q4), or as the checkpoint stored them
        # (gguf; its output head quantized here where the file's type is not one kept as stored).
        if engine_config.quantization in (INT8, Q4):
            params = quantize_params(params, config, engine_config.quantization)
        elif engine_config.quantization == GGUF:
            params = quantize_head(params, config)
        self.quantization = formats_of(params)
        pipeline = pipeline_layers(self.mesh, engine_config) if self.stages is not None else None
        self.model = DecoderModel(
            config,
            attention,
            self.dtype,
            engine_config.unroll_layers,
            matmul,
            experts,
            tuple(sorted(self.quantization.items())),
            pipeline,
        )
        self.cache_dtype = self.model.compute_dtype  # of activations
        # The KV cache's storage dtype (its format: kernels_pallas/kv_quant.py); auto: the weights'
        # dtype, as vLLM's, also on CPU where bf16 weights' activations are f32 (a bf16 cache halves
        # the bytes a decode step's attention reads: a batch-64 step at 256 tokens 0.69x the time).
        self.kv_dtype = jnp.dtype(engine_config.kv_storage_dtype)
        params = replicate_kv_heads(cast_params(params, self.dtype), plan, config.head_dim)
        if self.stages is not None:
            params = stage_params(params, self.stages)
        if matmul is not None:
            params = panel_kernels(params, matmul)
        if self.model.packed:
            params = pack_kernels(params)  # those the panels did not take
        self.param_shardings = param_shardings(params, self.mesh, config, self.quantization)
        # LoRA: the adapters' device slots ride in the parameters (`params["lora"]`), split like
        # the projections they update (jaxserve/runner/lora_slots.py).
        self.lora_slots = (
            None
            if not engine_config.enable_lora
            else LoraSlots(
                dataclasses.replace(config, num_kv_heads=plan.num_kv_heads),
                engine_config.max_loras,
                engine_config.max_lora_rank,
                self.model.compute_dtype,
                self.mesh,
                {m: s["kernel"].spec for m, s in self.param_shardings["layers"].items() if m in LORA_MODULES},
                plan.kv_replicas,
            )
        )
        if engine_config.unroll_layers:
            params = unstack_layers(params, config.num_layers, lambda leaf, i: leaf[i])
            self.param_shardings = unstack_layers(self.param_shardings, config.num_layers, layer_sharding)
        self.params = jax.device_put(params, self.param_shardings)
        if self.lora_slots is not None:
            self.params = {**self.params, "lora": self.lora_slots.zeros()}
            self.param_shardings = {**self.param_shardings, "lora": self.lora_slots.shardings}

        bs = engine_config.block_size
        block_bytes = engine_config.kv_block_bytes  # all devices' shards, scales included
        self.num_blocks = engine_config.num_blocks
        self.cache_sharding = cache_sharding(self.mesh)
        self.cache = jax.jit(
            lambda: KVCache.zeros(config, self.num_blocks, bs, self.kv_dtype), out_shardings=self.cache_sharding
        )()
        logger.info(
            "KV cache: %s, %d blocks of %d tokens (%d tokens in %.1f MB: %d tokens per GiB)",
            kv_quant.format_name(self.kv_dtype),
            self.num_blocks,
            bs,
            self.num_blocks * bs,
            self.num_blocks * block_bytes / 1e6,
            (1 << 30) * bs // block_bytes,
        )
        rep, kv = replicated(self.mesh), self.cache_sharding
        self.num_host_slots = engine_config.num_host_slots
        self.blocks = BlockMover(self.cache, kv, rep, self.num_host_slots)
        self._constants: dict[tuple, jax.Array] = {}
        self.inputs = StepInputs(engine_config, self._device_constant, config.vocab_size)

        self.functions = StepFunctions(
            self.model, config, self.mesh, bs, self.inputs.sampler_rows, self.inputs.pool_segments
        )
        self.penalty_counts = jax.jit(PenaltyCounts.zeros, static_argnums=(0, 1), out_shardings=rep)(
            engine_config.max_num_seqs, config.vocab_size
        )
        self._no_tokens = jax.device_put(np.zeros(self.inputs.sampled_rows, np.int32), rep)
        self._prev_sampled = self._no_tokens  # the last launched iteration's sampled tokens
        self.num_launches = 0
        self.last_prepare_time = self.last_launch_time = self.last_fetch_time = 0.0
        self.programs = declare_programs(self)
        self._executables: dict[tuple, Any] = {}  # by `ProgramSpec.key`
        self.num_compilations = 0
        # A mixture-of-experts model's token-to-expert assignments per expert (all layers): of the
        # last iteration read, and since the start (model steps; multi-step loops are not counted).
        self.last_expert_load = np.zeros(config.num_experts, np.int64)
        self.expert_tokens = np.zeros(config.num_experts, np.int64)
        # Pipeline stages: each stage's busy ticks and the ticks run, over the model steps read (no stages: none).
        self.pipeline_ticks = PipelineTicks(engine_config.pipeline_parallel_size if self.stages is not None else 0)
        # Multi-host: on process 0, called with every device operation of serving (an iteration's
        # programs or a block move) before it runs, so the other processes can `replay` it.
        self.mirror: Callable[[tuple], None] | None = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters as the runner holds them (all devices together): in its
        dtype, with the quantized kernels' codes, scales and mins (`--quantization`)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.params))

    def _device_constant(self, shape: tuple[int, ...], dtype: np.dtype, fill: object) -> jax.Array:
        """A filled array kept on the devices (sampling tables no row of a step uses, the offsets
        of the sampled buffer), so that steps do not ship them from the host."""
        key = (shape, np.dtype(dtype).str, fill)
        array = self._constants.get(key)
        if array is None:
            array = self._constants[key] = jax.device_put(np.full(shape, fill, dtype), replicated(self.mesh))
        return array

    # ----- programs and compilation ---------------------------------------------------------

    def _run(self, key: tuple, args: tuple, warming_up: bool = False) -> Any:
        """Run the program variant `key` (`ProgramSpec.key`): compiled at warm-up, or now (counted)."""
        exe = self._executables.get(key)
        if exe is None:
            if not warming_up:
                logger.warning("compiling a new variant at serving time: %s", key)
            exe = self.programs[key[0]].jitted.lower(*args).compile()
            self._executables[key] = exe
            self.num_compilations += 1
        return exe(*args)

    def step_args(self, program: Program, sampled: jax.Array | None = None) -> tuple:
        """The arguments of the compiled step of a prefill or verify program, or of a decode
        program with its sampling, whose tokens go to the buffer `sampled` (by default a fresh
        one). A constrained decode step does not sample (nor ship its mask table, written later)."""
        args = (self.params, self.cache, HostPack.of(program.host_args), self._prev_sampled)
        if not program.is_decode:
            return args
        sampled = self._no_tokens if sampled is None else sampled
        sampling = program.sampling
        if program.constrained:
            shape = sampling.token_mask.shape
            sampling = dataclasses.replace(sampling, token_mask=self._device_constant(shape, np.int32, -1))
        here = self._device_constant((), np.bool_, not program.constrained)
        return (*args, sampling, sampled, self._sample_offset(program), self.penalty_counts, here)

    def step_logits(self, program: Program, warming_up: bool = False) -> jax.Array:
        """Run a decode or prefill program's step alone, as in an iteration (its K/V written; a
        decode step's rows sampled too), and return its logits without waiting (benchmarks and
        tests read them)."""
        args = self.step_args(program)
        if not program.is_decode:
            logits, self.cache, _, _ = self._run(program.key, args, warming_up)
            return logits
        logits, self.cache, _, _, _, _, self.penalty_counts = self._run(program.key, args, warming_up)
        return logits

    def lora_write_args(self, slot: int, weights: LoraWeights | None) -> tuple:
        return (self.params["lora"], self._device_constant((), np.int32, slot), self.lora_slots.adapter_arrays(weights))

    def write_lora_slot(self, slot: int, weights: LoraWeights) -> None:
        """Put an adapter into device slot `slot` (`LoraManager`'s writer). Steps launched before
        read the slots as they were: the write makes new arrays, it does not update in place."""
        self.params = {**self.params, "lora": self._run(("lora_write",), self.lora_write_args(slot, weights))}

    def multi_step_args(self, program: Program) -> tuple:
        return (
            self.params,
            self.cache,
            HostPack.of(program.host_args),
            program.sampling,
            self._prev_sampled,
            self.penalty_counts,
        )

    def _sample_offset(self, program: Program) -> jax.Array:
        return self._device_constant((), np.int32, program.sample_offset)  # 0 or decode_offset: not shipped

    def sample_args(self, program: Program, logits: Any, sampled: jax.Array) -> tuple:
        return (logits, program.sampling, sampled, self._sample_offset(program), self.penalty_counts)

    def verify_args(self, program: Program, logits: Any) -> tuple:
        return (logits, program.sampling, self.penalty_counts, HostPack.of(program.drafts))

    def reset_args(self, reset: tuple[np.ndarray, ...]) -> tuple:
        return (self.penalty_counts, HostPack.of(reset), self._prev_sampled)

    def warm_up(self) -> float:
        """Compile every variant of every declared program (`_declare_programs`); return the
        seconds it took.

        Tracing and lowering hold the GIL and run one by one on this thread; each lowered
        program goes straight to a pool of a thread per core, so XLA compiles the earlier
        variants while later ones are being traced.
        """
        t0 = time.perf_counter()
        pending: dict[tuple, concurrent.futures.Future] = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            for spec in self.programs.values():
                for bucket, args in spec.variants():
                    key = spec.key(bucket)
                    if key not in self._executables and key not in pending:
                        pending[key] = pool.submit(spec.jitted.lower(*args).compile)
            for key, compiled in pending.items():
                self._executables[key] = compiled.result()
        self.num_compilations += len(pending)
        # The block moves have one shape each; compiling them here keeps serving free of it.
        self.cache = self.blocks.warm_up(self.cache)
        return time.perf_counter() - t0

    def bucket_summary(self) -> str:
        ec = self.engine_config
        return (
            f"decode batch {list(ec.decode_batch_buckets)} x block-table width {list(ec.block_table_buckets)}; "
            f"prefill tokens {list(ec.prefill_token_buckets)} x seqs {list(ec.prefill_seq_buckets)} "
            f"x width {list(ec.block_table_buckets)}: {ec.num_compiled_variants()} step variants; "
            f"sampler rows {list(ec.sampler_row_buckets)}"
            + (
                f"; verify (speculative, {self.inputs.verify_rows} rows per sequence) batch "
                f"{list(self.inputs.verify_batches)} x width {list(ec.block_table_buckets)}"
                if self.inputs.verify_rows
                else ""
            )
            + (
                f"; multi-step decode ({ec.num_scheduler_steps} steps) batch {list(ec.decode_batch_buckets)} x width "
                f"{list(ec.block_table_buckets)}"
                if ec.num_scheduler_steps > 1
                else ""
            )
        )

    # ----- execution ------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """An iteration's host arrays (see `StepInputs.prepare`). Host work only: it raises for a
        request whose inputs cannot be built before anything reaches the device."""
        t0 = time.perf_counter()
        prepared = self.inputs.prepare(sched)
        self.last_prepare_time = time.perf_counter() - t0
        return prepared

    def launch(self, sched: SchedulerOutput, prepared: PreparedStep) -> StepHandle:
        """Dispatch a prepared iteration (block moves, then its steps with their sampling) without
        waiting for the device. Inputs that are placeholders of the previous iteration are read
        from its sampled tokens on the device. An iteration with grammar masks (structured
        output) stops before writing the first (after that program's model step is dispatched;
        multi-host: before anything): `handle.awaits_masks`. The masks depend on the tokens of the
        iteration in flight: read it, then `complete_launch(handle)`."""
        t0 = time.perf_counter()
        self.move_blocks(sched.copy_stages)
        self.num_launches += 1
        handle = StepHandle(
            self.num_launches, [], _rest=self._run_steps(prepared.penalty_resets, prepared.programs), _prepared=prepared
        )
        self._dispatch(handle)
        self.last_launch_time = time.perf_counter() - t0
        return handle

    def complete_launch(self, handle: StepHandle) -> None:
        """Write the masks of a launch that `awaits_masks` and dispatch the rest of it."""
        t0 = time.perf_counter()
        self._dispatch(handle)
        self.last_launch_time += time.perf_counter() - t0

    def _dispatch(self, handle: StepHandle) -> None:
        """Run the launch on until it waits for masks or is all dispatched; then set up its reads."""
        try:
            next(handle._rest)
            return
        except StopIteration as done:
            outs, scores, pooled, handle.counters = done.value
        prepared, handle._rest, handle._prepared = handle._prepared, None, None
        self.inputs.batch.unset.difference_update(prepared.reset_requests)
        # The tokens of decode and prefill programs land in the sampled buffer, at their offsets.
        self.inputs.batch.launched(
            handle.launch_index,
            [(p.slots, p.sample_offset if p.drafts is None and p.num_steps == 1 else None) for p in prepared.programs],
        )
        for chunks, program, out in zip(prepared.parts, prepared.programs, outs):
            wanted = max(
                (c.request.params.logprobs for c in chunks if c.sample and c.request.params.logprobs is not None),
                default=None,
            )
            fields = (out.tokens,) if wanted is None else (out.tokens, out.logprobs) if wanted == 0 else tuple(out)
            for field in fields:
                field.copy_to_host_async()
            handle.parts.append((chunks, program.slots, fields))
        if scores is not None:
            for field in scores:
                field.copy_to_host_async()
            handle.prompt_scores = (prepared.prompt_scores, scores)
        if pooled is not None:
            pooled.copy_to_host_async()
            handle.pooled = (prepared.pooled, pooled)
        for counters in handle.counters:
            for field in counters:
                field.copy_to_host_async()

    def fetch(self, handle: StepHandle) -> list[tuple[ScheduledChunk, list[SampledToken]]]:
        """Wait for a launched iteration and read the tokens (and log-probabilities, if asked) that
        each of its sampling chunks produced: one, or for a verified decode its accepted drafts
        and the token after them."""
        t0 = time.perf_counter()
        handle.launches_before_fetch = self.num_launches
        results = []
        for chunks, slots, fields in handle.parts:
            tokens, *rest = (np.asarray(f) for f in fields)
            self.inputs.batch.read(handle.launch_index, slots, tokens)
            width = tokens.shape[1] if tokens.ndim == 2 else 1  # [B, k + 1] or [B, K]: verify, multi-step
            token_rows = tokens.reshape(-1, width).tolist()
            # Other fields are by row (a verified chunk's rows follow each other). Python floats
            # once per field: a numpy scalar per row costs more than the rest of the loop.
            logprobs = rest[0].tolist() if rest else None
            top_ids, top_logprobs = (rest[1], rest[2]) if len(rest) == 3 else (None, None)
            for i, c in enumerate(chunks):
                if not c.sample:
                    continue
                sampled = []
                for j, token in enumerate(token_rows[i]):
                    if token < 0:
                        break
                    row = i * width + j
                    lp = logprobs[row] if logprobs is not None else _NAN
                    if top_ids is None:
                        sampled.append(SampledToken(token, lp, _NO_TOP_IDS, _NO_TOP_LOGPROBS))
                    else:
                        sampled.append(SampledToken(token, lp, top_ids[row], top_logprobs[row]))
                results.append((c, sampled))
        self._count(handle.counters)
        self.last_fetch_time = time.perf_counter() - t0
        return results

    def _count(self, counters: list[StepCounters]) -> None:
        """Add a fetched iteration's model-step counters (already on the host) to the totals."""
        if not counters:
            return
        if self.config.num_experts:
            self.last_expert_load = sum(np.asarray(c.expert_load, np.int64) for c in counters)
            self.expert_tokens += self.last_expert_load
        if self.stages is not None:
            for c in counters:
                self.pipeline_ticks.add(np.asarray(c.pipeline_ticks))

    def _run_steps(
        self, penalty_resets: list[tuple], programs: list[Program], warming_up: bool = False
    ) -> Generator[None, None, StepResults]:
        """Run one iteration: first the penalty rows of requests that just got a slot, then the
        programs (and the prompt scores and pooled rows of the one that has any). The sampled
        tokens land in a fresh buffer that becomes the next iteration's `prev_sampled`. Returns
        the programs' sampler outputs, the prompt scores, the pooled sums and the model steps'
        counters (when there is anything to count: experts, pipeline stages). Before the first
        grammar mask is written (while that program's model step runs; multi-host: before
        anything, for the followers' copy), it yields once: the caller brings the grammars up to
        date (see `launch`)."""
        awaiting = any(p.masks for p in programs)  # the first mask write waits for the caller
        if self.mirror is not None and not warming_up:
            if awaiting:
                yield
                awaiting = False
            programs = [write_token_masks(p) for p in programs]
            self.mirror(("steps", penalty_resets, programs))
        for reset in penalty_resets:
            self.penalty_counts = self._run(("penalty_reset",), self.reset_args(reset), warming_up)
        sampled, outs, scores, pooled, counters = self._no_tokens, [], None, None, []
        for program in programs:
            if program.num_steps > 1:
                args = self.multi_step_args(program)
                out, self.cache, self.penalty_counts = self._run(program.key, args, warming_up)
                outs.append(out)
                continue
            if program.drafts is not None:
                logits, self.cache, _, step_counters = self._run(program.key, self.step_args(program), warming_up)
                counters.append(step_counters)
                if awaiting and program.masks:
                    yield
                    awaiting = False
                verify_args = self.verify_args(write_token_masks(program), logits)
                out, self.penalty_counts = self._run(("verify_sample", logits.shape[0]), verify_args, warming_up)
                outs.append(out)
                continue
            args = self.step_args(program, sampled)
            if program.is_decode:
                logits, self.cache, hidden, step_counters, out, sampled, self.penalty_counts = self._run(
                    program.key, args, warming_up
                )
            else:
                logits, self.cache, hidden, step_counters = self._run(program.key, args, warming_up)
            counters.append(step_counters)
            if program.score is not None:
                score_args = (self.params, hidden, HostPack.of(program.score))
                scores = self._run(("score", hidden.shape[0]), score_args, warming_up)
            if program.pool is not None:
                pool_args = (self.params, hidden, HostPack.of(program.pool))
                pooled = self._run(("pool", hidden.shape[0]), pool_args, warming_up)
            if program.constrained or not program.is_decode:
                if awaiting and program.masks:
                    yield
                    awaiting = False
                sample_args = self.sample_args(write_token_masks(program), logits, sampled)
                out, sampled, self.penalty_counts = self._run(("sample", logits.shape[0]), sample_args, warming_up)
            outs.append(out)
        self._prev_sampled = sampled
        counted = self.config.num_experts or self.stages is not None
        return outs, scores, pooled, counters if counted else []

    def move_blocks(self, stages: list[CopyStage]) -> None:
        """Execute the KV manager's copy plan, stage by stage, in order (a step does it first)."""
        for stage in stages:
            for i in range(0, len(stage), BLOCK_MOVE_CHUNK):
                op = ("move", stage.kind, stage.src[i : i + BLOCK_MOVE_CHUNK], stage.dst[i : i + BLOCK_MOVE_CHUNK])
                if self.mirror is not None:
                    self.mirror(op)
                self.cache = self.blocks.move(self.cache, *op[1:])

    def replay(self, op: tuple) -> None:
        """Run a device operation that process 0's runner passed to its `mirror` (multi-host:
        every process must launch the same computations in the same order)."""
        if op[0] == "steps":
            run_to_end(self._run_steps(op[1], op[2]))
        elif op[0] == "move":
            self.cache = self.blocks.move(self.cache, *op[1:])
        else:
            raise ValueError(f"unknown mirrored operation {op[0]!r}")


def run_to_end(steps: Generator[None, None, Any]) -> Any:
    """Drive `_run_steps` to its end when nothing needs doing at its pause (masks already written)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


_NAN = float("nan")
_NO_TOP_IDS = np.zeros(0, np.int32)
_NO_TOP_LOGPROBS = np.zeros(0, np.float32)
