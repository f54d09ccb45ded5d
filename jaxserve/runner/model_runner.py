"""The model runner: owns the device state, compiles the bucketed programs and runs a prepared
iteration's programs on the devices.

The runner holds one `DeviceState` (parameters with the LoRA slots, the KV cache, the sampler's
state) and every program is a pure function of it, `(state, inputs) -> (state, outputs)`, that
takes the state over: the runner replaces `state` with each program's result (`_call`).

`warm_up()` compiles every bucket ahead of time (`lower().compile()`), and `num_compilations`
counts every compilation, so a test can prove that serving after warm-up compiles nothing.
An iteration is dispatched without waiting for the device in two calls: `run_model` (block moves,
penalty resets, model steps; a plain decode step samples in its own program, one dispatch), then
`run_sampler` (the grammar masks of constrained rows written, then the samplers of the logits the
model steps left); its sampled tokens are read later (`fetch`). The next iteration may be launched
in between, reading the tokens it needs from this one's sampled buffer on the device.

Multi-host: every device operation of serving goes through `_device`, which a group leader's
`mirror` sends to the other processes first; they run the same operation (`replay`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from checkpoints.digest import weights_digest
from checkpoints.loaded import VisionTower
from jaxserve.kv import CopyKind, CopyStage
from jaxserve.lora.peft import LoraWeights
from jaxserve.model import KVCache
from jaxserve.model.state_cache import ModelCaches, copy_states, paged_of, with_paged
from jaxserve.outputs import SampledToken
from jaxserve.resolved_config import ResolvedConfig
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK, BlockMover, padded_moves
from jaxserve.runner.device_state import DeviceState, SamplerState, state_shardings
from jaxserve.runner.executables import Executables
from jaxserve.runner.host_heap import keep_freed_blocks
from jaxserve.runner.inputs import StepInputs
from jaxserve.runner.iteration import ModelPhase, run_model_steps, run_samplers
from jaxserve.runner.model_setup import build_cache, caches_sharding, serve_model
from jaxserve.runner.placement import enable_persistent_compilation_cache, runner_mesh
from jaxserve.runner.prepared_step import PreparedStep, Program, write_token_masks
from jaxserve.runner.program_args import DeviceConstants, ProgramArgs
from jaxserve.runner.programs import ProgramSetting, declare_programs
from jaxserve.runner.step_counters import StepTotals
from jaxserve.runner.step_functions import StepFunctions
from jaxserve.runner.step_handle import StepHandle, read_tokens, start_reads
from jaxserve.runner.vision_encoder import VisionEncoder
from jaxserve.sampling_tensors import PenaltyCounts
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from sharding.rules import cache_sharding, replicated


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params: Any,
        engine_config: ResolvedConfig,
        mesh: Mesh | None = None,
        vision: VisionTower | None = None,
    ):
        if not isinstance(engine_config, ResolvedConfig):
            raise TypeError("ModelRunner takes a ResolvedConfig: jaxserve.config_resolution.resolve(config, model)")
        self.engine_config = ec = engine_config
        self.weights_digest = weights_digest(params)  # of the checkpoint's arrays, before any layout here
        if jax.default_backend() == "cpu":
            keep_freed_blocks()  # each step's temporaries reuse the last one's pages (host_heap)
        if ec.compilation_cache_dir:
            enable_persistent_compilation_cache(ec.compilation_cache_dir)
        self.mesh = runner_mesh(ec, mesh)
        served = serve_model(config, params, ec, self.mesh)
        self.config, self.model, self.stages = served.config, served.model, served.stages
        self.dtype, self.quantization, self.kv_dtype = served.dtype, served.quantization, served.kv_dtype
        self.attention_backend, self.lora_slots = served.attention_backend, served.lora_slots
        self.cache_dtype = self.model.compute_dtype  # of activations
        cache = build_cache(self.config, ec, self.mesh, self.kv_dtype)
        self.num_blocks = cache.num_blocks
        self.num_host_slots = ec.num_host_slots
        rep = replicated(self.mesh)
        self.blocks = BlockMover(
            paged_of(cache), cache_sharding(self.mesh, self.config.is_mla), rep, self.num_host_slots
        )
        kv = caches_sharding(self.config, self.mesh, ec.block_size)
        self._copy_states = jax.jit(copy_states, donate_argnums=(0,), out_shardings=kv)
        constant = DeviceConstants(rep)
        # A vision-language model's encoder program and cache (None: text only).
        step_tokens = ec.max_num_batched_tokens
        self.vision = None if vision is None else VisionEncoder(vision, self.dtype, self.mesh, step_tokens)
        self.inputs = StepInputs(ec, constant, self.config.vocab_size, self.vision and self.vision.cache)
        self.args = ProgramArgs(constant, self.lora_slots)
        self.state = DeviceState(served.params, served.adapters, cache, self._sampler_state(rep))
        functions = StepFunctions(
            self.model, self.config, self.mesh, ec.block_size, self.inputs.sampler_rows, self.inputs.pool_segments
        )
        adapters = None if self.lora_slots is None else self.lora_slots.shardings
        shardings = state_shardings(served.param_shardings, adapters, kv, rep)
        # The variants are lowered for the state's shapes and placement (not its arrays, which serving takes over).
        example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        setting = ProgramSetting(functions, ec, self.inputs, self.args, example, shardings, rep)
        self.executables = Executables(declare_programs(setting))
        self.num_launches = 0
        self.last_prepare_time = self.last_launch_time = self.last_fetch_time = 0.0
        stages = ec.pipeline_parallel_size if self.stages is not None else 0
        self.totals = StepTotals(self.config.num_experts, stages)
        # Multi-host: on process 0, called with every device operation of serving (see `_device`)
        # before it runs, so the other processes can `replay` it.
        self.mirror: Callable[[tuple], None] | None = None
        # MTP speculation: each iteration's last hidden states are read too (`read_hidden`).
        self.keep_hidden = False
        # Launches between their model and sampler phases: the phase, and the programs it ran.
        self._unsampled: dict[int, tuple[ModelPhase, list[Program]]] = {}

    def _sampler_state(self, rep: Any) -> SamplerState:
        ec, rows = self.engine_config, self.inputs.sampled_rows
        counts = jax.jit(PenaltyCounts.zeros, static_argnums=(0, 1), out_shardings=rep)(
            ec.max_num_seqs, self.config.vocab_size
        )
        # Two buffers of their own: each is taken over by the programs that write it.
        return SamplerState(counts, *(jax.device_put(np.zeros(rows, np.int32), rep) for _ in range(2)))

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def cache(self) -> KVCache:
        """The paged KV cache (a hybrid's full-attention layers'; its states are in `state.cache`)."""
        return paged_of(self.state.cache)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters as the runner holds them (all devices together): in its
        dtype, with the quantized kernels' codes, scales and mins (`--quantization`)."""
        return sum(x.nbytes for x in jax.tree.leaves((self.state.params, self.state.adapters)))

    @property
    def num_compilations(self) -> int:
        return self.executables.num_compilations + (self.vision.num_compilations if self.vision else 0)

    # ----- programs and compilation ---------------------------------------------------------

    def _call(self, key: tuple, *inputs: Any, warming_up: bool = False) -> Any:
        """Run program variant `key` on the state (which it takes over) and return its outputs."""
        self.state, outputs = self.executables.run(key, self.state, inputs, warming_up)
        return outputs

    def step_args(self, program: Program) -> tuple:
        """The arguments of a prefill, verify or decode program's step (benchmarks lower it)."""
        return (self.state, *self.args.step(program))

    def step_logits(self, program: Program, warming_up: bool = False) -> jax.Array:
        """Run a decode or prefill program's step alone, as in an iteration (its K/V written; a
        decode step's rows sampled too), and return its logits without waiting (benchmarks and
        tests read them)."""
        return self._call(program.key, *self.args.step(program), warming_up=warming_up).logits

    def write_lora_slot(self, lora_slot: int, weights: LoraWeights) -> None:
        """Put an adapter into LoRA slot `lora_slot` (`LoraManager`'s writer). Steps launched before
        read the LoRA slots as they were: the write runs after them on the devices."""
        self._device("lora_write", lora_slot, weights)

    def warm_up(self) -> float:
        """Compile every variant of every declared program (`programs.declare_programs`) and the
        block moves; return the seconds it took."""
        t0 = time.perf_counter()
        self.executables.compile_all()
        if self.vision is not None:
            self.vision.warm_up()
        # The block moves have one shape each; compiling them here keeps serving free of it.
        self._update_paged(self.blocks.warm_up)
        if isinstance(self.state.cache, ModelCaches):
            self._move(CopyKind.STATE, [0], [0])
        return time.perf_counter() - t0

    def bucket_summary(self) -> str:
        ec, inputs = self.engine_config, self.inputs
        widths = list(ec.block_table_buckets)
        return (
            f"decode batch {list(ec.decode_batch_buckets)} x block-table width {widths}; "
            f"prefill tokens {list(ec.prefill_token_buckets)} x seqs {list(ec.prefill_seq_buckets)} "
            f"x width {widths}: {ec.num_compiled_variants()} step variants; "
            f"sampler rows {list(ec.sampler_row_buckets)}"
            + (
                f"; verify (speculative, {inputs.verify_rows} rows per sequence) batch "
                f"{list(inputs.verify_batches)} x width {widths}"
                if inputs.verify_rows
                else ""
            )
            + (
                f"; multi-step decode ({ec.num_scheduler_steps} steps) batch {list(ec.decode_batch_buckets)} x width "
                f"{widths}"
                if ec.num_scheduler_steps > 1
                else ""
            )
        )

    # ----- an iteration -----------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """An iteration's host arrays (see `StepInputs.prepare`). Host work only: it raises for a
        request whose inputs cannot be built before anything reaches the device."""
        t0 = time.perf_counter()
        if self.vision is not None:  # the prefill chunks' images encoded (or found in its cache) first
            self.vision.encode_step(sched.prefills)
        prepared = self.inputs.prepare(sched)
        self.last_prepare_time = time.perf_counter() - t0
        return prepared

    def run_model(self, sched: SchedulerOutput, prepared: PreparedStep) -> StepHandle:
        """Dispatch a prepared iteration's block moves, penalty resets and model steps without
        waiting for the device; a plain decode step samples its rows in the same program. Inputs
        that are placeholders of the previous iteration are read from its sampled tokens on the
        device. Then `run_sampler`: when `handle.awaits_masks` (structured output), the masks
        depend on the tokens of the iteration in flight: read it first."""
        t0 = time.perf_counter()
        self.move_blocks(sched.copy_stages)
        self.num_launches += 1
        programs = [p._replace(masks=()) if p.masks else p for p in prepared.programs]  # masks: at the sampler
        self._device("model", self.num_launches, prepared.penalty_resets, programs)
        self.last_launch_time = time.perf_counter() - t0
        return StepHandle(self.num_launches, [], prepared=prepared)

    def run_sampler(self, handle: StepHandle) -> None:
        """Write the grammar masks of an iteration's constrained rows, dispatch the samplers of the
        logits its model steps left, and start copying what the host reads of it."""
        t0 = time.perf_counter()
        masks = [write_token_masks(p).sampling.token_mask if p.masks else None for p in handle.prepared.programs]
        phase, outs = self._device("sample", handle.launch_index, masks)
        start_reads(handle, self.inputs.batch, phase, outs, self.totals.counts_anything, self.keep_hidden)
        self.last_launch_time += time.perf_counter() - t0

    def fetch(self, handle: StepHandle) -> list[tuple[ScheduledChunk, list[SampledToken]]]:
        """Wait for a launched iteration and read its sampled tokens (see `read_tokens`)."""
        t0 = time.perf_counter()
        handle.launches_before_fetch = self.num_launches
        results = read_tokens(handle, self.inputs.batch)
        self.totals.add(handle.counters)
        self.last_fetch_time = time.perf_counter() - t0
        return results

    def move_blocks(self, stages: list[CopyStage]) -> None:
        """Execute the KV manager's copy plan, stage by stage, in order (a step does it first)."""
        for stage in stages:
            for i in range(0, len(stage), BLOCK_MOVE_CHUNK):
                chunk = slice(i, i + BLOCK_MOVE_CHUNK)
                self._device("move", stage.kind, stage.src[chunk], stage.dst[chunk])

    def write_blocks(self, write: Callable[..., KVCache], *args: Any) -> None:
        """Update the KV cache to `write(cache, *args)`, which takes it over (KV handed in by another
        engine: `kv_transfer`). Not mirrored: a multi-host group takes no KV handoffs."""
        self._update_paged(lambda paged: write(paged, *args))

    # ----- device operations (mirrored to a multi-host group's other processes) --------------

    def _device(self, op: str, *args: Any) -> Any:
        """Run device operation `op` (see `_OPERATIONS`); a multi-host leader first sends it to its
        group's other processes (`mirror`), which run the same (`replay`), in the same order."""
        if self.mirror is not None:
            self.mirror((op, *args))
        return _OPERATIONS[op](self, *args)

    def replay(self, op: tuple) -> None:
        """Run a device operation that process 0's runner passed to its `mirror`."""
        if op[0] not in _OPERATIONS:
            raise ValueError(f"unknown mirrored operation {op[0]!r}")
        _OPERATIONS[op[0]](self, *op[1:])

    def _model_phase(self, launch_index: int, penalty_resets: list[tuple], programs: list[Program]) -> None:
        self.state = self.state.next_iteration()
        self._unsampled[launch_index] = run_model_steps(self._call, self.args, penalty_resets, programs), programs

    def _sampler_phase(self, launch_index: int, masks: list[np.ndarray | None]) -> tuple[ModelPhase, list]:
        """The samplers of launch `launch_index`'s programs (kept from its model phase), with the
        grammar masks written since (per program, its token mask table; None: none): the mirrored
        operation carries the masks alone."""
        phase, programs = self._unsampled.pop(launch_index)
        programs = [
            p if m is None else p._replace(sampling=dataclasses.replace(p.sampling, token_mask=m))
            for p, m in zip(programs, masks)
        ]
        return phase, run_samplers(self._call, self.args, phase, programs)

    def _move(self, kind: CopyKind, src: list[int], dst: list[int]) -> None:
        if kind is CopyKind.STATE:  # a hybrid's state snapshot taken or restored (jaxserve/kv/state_snapshots.py)
            self.state = self.state.with_cache(self._copy_states(self.state.cache, *padded_moves(src, dst)))
            return
        self._update_paged(lambda paged: self.blocks.move(paged, kind, src, dst))

    def _update_paged(self, update: Callable[[KVCache], KVCache]) -> None:
        """Replace the paged KV cache by `update(paged cache)` (which takes it over)."""
        caches = self.state.cache
        self.state = self.state.with_cache(with_paged(caches, update(paged_of(caches))))

    def _write_lora(self, lora_slot: int, weights: LoraWeights) -> None:
        self._call(("lora_write",), *self.args.lora_write(lora_slot, weights))


# The runner's device operations by name: what `ModelRunner._device` runs and mirrors.
_OPERATIONS: dict[str, Callable[..., Any]] = {
    "model": ModelRunner._model_phase,
    "sample": ModelRunner._sampler_phase,
    "move": ModelRunner._move,
    "lora_write": ModelRunner._write_lora,
}
