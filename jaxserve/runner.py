"""Model runner: turns a SchedulerOutput into bucketed arrays and runs the compiled steps.

Every jitted step sees only bucketed shapes: a decode step is keyed by (batch, block-table
width), a ragged prefill step by (tokens, sequences, block-table width). `warm_up()` compiles
the whole cross product ahead of time (`lower().compile()`), and `num_compilations` counts every
compilation, so a test can prove that serving after warm-up compiles nothing.

The KV cache is donated to every step and updated in place. Block moves planned by the KV
manager (copy-on-write copies, swap-out to and swap-in from the host tier) run as small jitted
gathers and scatters of a fixed chunk size, before the model step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from checkpoints.params import param_shapes
from jaxserve import faults
from jaxserve.config import EngineConfig, bucket_for
from jaxserve.kv import CopyKind
from jaxserve.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.model import AttentionMetadata, KVCache, LlamaModel
from jaxserve.sampler import (PenaltyCounts, RowSampling, SamplerOutput, SamplingTensors, penalty_history, sample,
                              set_penalty_rows)
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from kernels_pallas import default_attention_backend, get_attention_backend, shard_attention
from sharding.kv_heads import replicate_kv_heads
from sharding.mesh import make_mesh, plan_tensor_parallel
from sharding.rules import cache_sharding, param_shardings, replicated

logger = logging.getLogger(__name__)

BLOCK_MOVE_CHUNK = 32  # block copies / swaps are padded to this many (block 0 -> block 0)
PENALTY_RESET_ROWS = 4  # penalty slots set from histories per call (one compiled shape)


class PenaltySlots:
    """Rows of the device's PenaltyCounts, one per running request with penalties. A request
    gets one when it first samples in a run and gives it back when it stops running (finished
    or preempted: it gets a fresh row, set from its history, when it runs again)."""

    def __init__(self, num_slots: int):
        self.spare = num_slots  # the zero row of rows without penalties
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[Request, int] = {}
        self.unset: set[Request] = set()  # given a slot whose row is not set on the device yet

    def slot(self, req: Request) -> int:
        return self._slots[req]

    def holds(self, req: Request) -> bool:
        return req in self._slots

    def join(self, req: Request) -> None:
        if req not in self._slots:
            self._slots[req] = self._free.pop()
            self.unset.add(req)

    def release_finished(self) -> None:
        for req in [r for r in self._slots if r.status is not RequestStatus.RUNNING]:
            self._free.append(self._slots.pop(req))
            self.unset.discard(req)


@dataclasses.dataclass
class StepHandle:
    """A launched iteration: for each of its programs, the chunks and the sampler outputs the
    host will read (tokens; log-probabilities only when a chunk asked for them)."""

    launch_index: int  # 1 for the runner's first launch
    parts: list[tuple[list[ScheduledChunk], tuple[jax.Array, ...]]]
    launches_before_fetch: int = 0  # set by fetch: > launch_index when the next one went first


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_ids: np.ndarray  # [K] int32
    top_logprobs: np.ndarray  # [K] float32


def enable_persistent_compilation_cache(path: str) -> None:
    """JAX's on-disk compilation cache: a restart with the same buckets compiles nothing new."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _cast_params(params: Any, dtype: jnp.dtype) -> Any:
    """Matrices and embeddings in the compute dtype; norm scales stay f32. Arrays already on
    devices (restored into shards) are cast there, never pulled back to the host."""
    def cast(path, x):
        target = np.float32 if "scale" in jax.tree_util.keystr(path) else dtype
        return x.astype(target) if isinstance(x, jax.Array) else np.asarray(x, target)
    return jax.tree_util.tree_map_with_path(cast, params)


def _runner_mesh(engine_config: EngineConfig, mesh: Mesh | None = None) -> Mesh:
    """The 1 x tp mesh a runner's replica runs on (checked; by default the first tp devices)."""
    if mesh is None:
        if engine_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs one engine per replica; build them with jaxserve.dp_router.make_engine"
            )
        return make_mesh(engine_config.tensor_parallel_size)
    if mesh.shape["dp"] != 1 or mesh.shape["tp"] != engine_config.tensor_parallel_size:
        raise ValueError(
            f"a runner needs a 1 x tensor_parallel_size ({engine_config.tensor_parallel_size}) mesh, "
            f"got dp x tp = {mesh.shape['dp']} x {mesh.shape['tp']}"
        )
    return mesh


def checkpoint_shardings(engine_config: EngineConfig, mesh: Mesh | None = None) -> Callable[[ModelConfig], Any]:
    """Where a checkpoint's parameters are restored, for `load_model(shardings=...)`: the rules'
    shardings of the checkpoint's own shapes on the runner's mesh (kv heads are repeated later,
    on device, when tp needs more of them). A model tp cannot split is refused before any read."""
    def shardings(config: ModelConfig) -> Any:
        plan_tensor_parallel(config.num_heads, config.num_kv_heads, engine_config.tensor_parallel_size)
        return param_shardings(param_shapes(config), _runner_mesh(engine_config, mesh))
    return shardings


class ModelRunner:
    def __init__(self, config: ModelConfig, params: Any, engine_config: EngineConfig, mesh: Mesh | None = None):
        self.engine_config = engine_config
        if engine_config.compilation_cache_dir:
            enable_persistent_compilation_cache(engine_config.compilation_cache_dir)
        # Tensor parallel: heads split over "tp"; kv heads repeated where tp needs more of them,
        # so `self.config` (what the model and cache are built with) may have more kv heads.
        plan = plan_tensor_parallel(config.num_heads, config.num_kv_heads, engine_config.tensor_parallel_size)
        self.mesh = _runner_mesh(engine_config, mesh)
        self.config = config = dataclasses.replace(config, num_kv_heads=plan.served_kv_heads)
        self.dtype = jnp.dtype(engine_config.dtype)
        self.attention_backend = engine_config.attention_backend or default_attention_backend()
        attention = shard_attention(get_attention_backend(self.attention_backend), self.mesh, "tp")
        self.model = LlamaModel(config, attention, self.dtype)
        params = replicate_kv_heads(_cast_params(params, self.dtype), plan, config.head_dim)
        self.param_shardings = param_shardings(params, self.mesh)
        self.params = jax.device_put(params, self.param_shardings)

        bs = engine_config.block_size
        tp = engine_config.tensor_parallel_size  # kv_cache_memory is per device
        self.num_blocks = engine_config.num_blocks or max(
            2, engine_config.kv_cache_memory * tp // KVCache.bytes_per_block(config, bs, self.dtype)
        )
        self.cache_sharding = cache_sharding(self.mesh)
        self.cache = jax.jit(
            lambda: KVCache.zeros(config, self.num_blocks, bs, self.dtype), out_shardings=self.cache_sharding
        )()
        host_shape = (config.num_layers, config.num_kv_heads, max(engine_config.swap_space_blocks, 1), bs, config.head_dim)
        self.host_k = np.zeros(host_shape, self.dtype)
        self.host_v = np.zeros(host_shape, self.dtype)

        # Explicit shardings on every executable: host inputs replicated, logits gathered to the
        # full vocabulary once (out_shardings), the cache kept split over kv heads and donated.
        rep, kv = replicated(self.mesh), self.cache_sharding
        self._step = jax.jit(
            self._step_fn, donate_argnums=(1,),
            in_shardings=(self.param_shardings, kv, rep, rep, rep, rep, rep, rep), out_shardings=(rep, kv),
        )
        # Sampling is its own executable, keyed by row count only (its penalty history always
        # spans max_model_len), so it compiles once per row bucket, not once per step shape.
        self._sample = jax.jit(self._sample_fn, donate_argnums=(4,), in_shardings=rep, out_shardings=rep)
        # Penalty state on the device: one row of token counts per request with penalties.
        self.penalty_slots = PenaltySlots(engine_config.max_num_seqs)
        self.penalty_counts = jax.jit(PenaltyCounts.zeros, static_argnums=(0, 1), out_shardings=rep)(
            engine_config.max_num_seqs, config.vocab_size)
        self._set_penalty_rows = jax.jit(self._set_penalty_rows_fn, donate_argnums=(0,), in_shardings=rep, out_shardings=rep)
        # Each iteration's sampled tokens, at fixed rows (prefill chunk i at i, decode row j at
        # `decode_offset + j`), stay on the device for the next iteration's placeholders.
        self.decode_offset = self._sampler_rows(max(engine_config.prefill_seq_buckets))
        self.sampled_rows = self.decode_offset + self._sampler_rows(max(engine_config.decode_batch_buckets))
        self._no_tokens = jax.device_put(np.zeros(self.sampled_rows, np.int32), rep)
        self._prev_sampled = self._no_tokens
        self.num_launches = 0  # iterations launched (a step handle records the count it saw)
        self._sampled_rows: dict[Request, int] = {}  # the last launch's rows in its sampled buffer
        self.last_prepare_time = self.last_launch_time = self.last_fetch_time = 0.0
        self._copy = jax.jit(self._copy_fn, donate_argnums=(0,), in_shardings=(kv, rep, rep), out_shardings=kv)
        self._gather = jax.jit(self._gather_fn, in_shardings=(kv, rep), out_shardings=kv)
        self._scatter = jax.jit(
            self._scatter_fn, donate_argnums=(0,), in_shardings=(kv, rep, kv, kv), out_shardings=kv
        )
        self._executables: dict[tuple, Any] = {}
        self._constants: dict[tuple, jax.Array] = {}
        self.num_compilations = 0
        # Multi-host: on process 0, called with every device operation of serving (a bucketed
        # step or a block move) before it runs, so the other processes can `replay` it.
        self.mirror: Callable[[tuple], None] | None = None

    # ----- the jitted functions -------------------------------------------------------------

    def _step_fn(self, params, cache, tokens, positions, meta, logits_indices, prev_sampled, token_src):
        # Rows whose token the previous step sampled (a PLACEHOLDER on the host) read it here.
        tokens = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], tokens)
        logits, cache = self.model.apply({"params": params}, tokens, positions, cache, meta, logits_indices)
        rows = logits.shape[0]  # padded to the sampler's bucket (padding rows are zeros)
        return jnp.pad(logits, ((0, self._sampler_rows(rows) - rows), (0, 0))), cache

    def _sampler_rows(self, rows: int) -> int:
        return bucket_for(rows, self.engine_config.sampler_row_buckets)

    @staticmethod
    def _sample_fn(logits, sampling, sampled, offset, counts):
        """Sample, and also write the tokens into this iteration's `sampled` buffer at `offset`."""
        out, counts = sample(logits, sampling, counts)
        return out, lax.dynamic_update_slice(sampled, out.tokens, (offset,)), counts

    @staticmethod
    def _copy_fn(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
        return KVCache(cache.k.at[:, :, dst].set(cache.k[:, :, src]), cache.v.at[:, :, dst].set(cache.v[:, :, src]))

    @staticmethod
    def _gather_fn(cache: KVCache, blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
        return cache.k[:, :, blocks], cache.v[:, :, blocks]

    @staticmethod
    def _scatter_fn(cache: KVCache, blocks: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        return KVCache(cache.k.at[:, :, blocks].set(k), cache.v.at[:, :, blocks].set(v))

    # ----- compilation ----------------------------------------------------------------------

    def _compiled(self, key: tuple, fn, args: tuple, warming_up: bool = False):
        exe = self._executables.get(key)
        if exe is None:
            if not warming_up:
                logger.warning("compiling a new variant at serving time: %s", key)
            exe = fn.lower(*args).compile()
            self._executables[key] = exe
            self.num_compilations += 1
        return exe

    def _run_steps(self, penalty_resets: list[tuple], programs: list[tuple], warming_up: bool = False) -> list[SamplerOutput]:
        """Run one iteration: first the penalty rows of requests that just got a slot (each reset
        is (slots, histories, is_output) of PENALTY_RESET_ROWS rows), then the programs, each
        (key, host_args, sampling, offset) with host_args = (tokens, positions, meta,
        logits_indices, token_src). Their sampled tokens land in a fresh buffer that becomes the
        next iteration's `prev_sampled`."""
        if self.mirror is not None and not warming_up:
            self.mirror(("steps", penalty_resets, programs))
        for reset in penalty_resets:
            args = (self.penalty_counts, *reset[:3], self._prev_sampled, *reset[3:])
            self.penalty_counts = self._compiled(("penalty_reset",), self._set_penalty_rows, args, warming_up)(*args)
        sampled, outs = self._no_tokens, []
        for program in programs:
            key, _, sampling, offset = program
            args = self.step_args(program)
            logits, self.cache = self._compiled(key, self._step, args, warming_up)(*args)
            sample_args = (logits, sampling, sampled, np.int32(offset), self.penalty_counts)
            out, sampled, self.penalty_counts = self._compiled(
                ("sample", logits.shape[0]), self._sample, sample_args, warming_up)(*sample_args)
            outs.append(out)
        self._prev_sampled = sampled
        return outs

    @staticmethod
    def _set_penalty_rows_fn(counts, slots, history, is_output, prev_sampled, token_src, token_index):
        """set_penalty_rows, after the history token at `token_index` of each row whose
        `token_src` >= 0 (a placeholder on the host) is read from the previous iteration."""
        rows = jnp.arange(history.shape[0])
        pending = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], history[rows, token_index])
        return set_penalty_rows(counts, slots, history.at[rows, token_index].set(pending), is_output)

    def step_args(self, program: tuple) -> tuple:
        """The arguments of the compiled model step for a prepared program (see `prepare`)."""
        _, (tokens, positions, meta, logits_indices, token_src), _, _ = program
        return (self.params, self.cache, tokens, positions, meta, logits_indices, self._prev_sampled, token_src)

    def warm_up(self) -> float:
        """Compile every bucket of both steps and the samplers; return the seconds it took.

        Tracing and lowering hold the GIL and run one by one on this thread; each lowered
        program goes straight to a pool of a thread per core, so XLA compiles the earlier
        variants while later ones are being traced.
        """
        ec = self.engine_config
        t0 = time.perf_counter()
        variants = [self._decode_arrays([], b, w) for w in ec.block_table_buckets for b in ec.decode_batch_buckets]
        variants += [self._prefill_arrays([], t, s, w) for w in ec.block_table_buckets
                     for t in ec.prefill_token_buckets for s in ec.prefill_seq_buckets]
        pending: dict[tuple, concurrent.futures.Future] = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            for program in variants:
                key, (*_, logits_indices, _), sampling, offset = program
                args = self.step_args(program)
                rows = self._sampler_rows(logits_indices.shape[0])
                logits = jax.ShapeDtypeStruct((rows, self.config.vocab_size), jnp.float32)
                sample_args = (logits, sampling, self._no_tokens, np.int32(offset), self.penalty_counts)
                for program_key, fn, program_args in ((key, self._step, args),
                                                      (("sample", rows), self._sample, sample_args)):
                    if program_key not in self._executables and program_key not in pending:
                        pending[program_key] = pool.submit(fn.lower(*program_args).compile)
            reset = self._penalty_reset([], {})
            args = (self.penalty_counts, *reset[:3], self._prev_sampled, *reset[3:])
            pending[("penalty_reset",)] = pool.submit(self._set_penalty_rows.lower(*args).compile)
            for key, compiled in pending.items():
                self._executables[key] = compiled.result()
        self.num_compilations += len(pending)
        # The block-move helpers have one shape each; compiling them here keeps serving free of it.
        zeros = np.zeros(BLOCK_MOVE_CHUNK, np.int32)
        self.cache = self._copy(self.cache, zeros, zeros)
        k, v = self._gather(self.cache, zeros)
        self.cache = self._scatter(self.cache, zeros, k, v)
        return time.perf_counter() - t0

    def bucket_summary(self) -> str:
        ec = self.engine_config
        return (
            f"decode batch {list(ec.decode_batch_buckets)} x block-table width {list(ec.block_table_buckets)}; "
            f"prefill tokens {list(ec.prefill_token_buckets)} x seqs {list(ec.prefill_seq_buckets)} "
            f"x width {list(ec.block_table_buckets)}: {ec.num_compiled_variants()} step variants; "
            f"sampler rows {list(ec.sampler_row_buckets)}"
        )

    # ----- building bucketed arrays ---------------------------------------------------------

    def _width_bucket(self, chunks: list[ScheduledChunk]) -> int:
        bs = self.engine_config.block_size
        need = max((-(-(c.start + c.num_new_tokens) // bs) for c in chunks), default=1)
        return bucket_for(need, self.engine_config.block_table_buckets)

    def _row_sampling(self, chunk: ScheduledChunk) -> RowSampling | None:
        if not chunk.sample:
            return None
        req = chunk.request
        faults.check("sampling", req)
        held_back = len(req.output_token_ids) < req.params.min_tokens  # no stop token yet
        return RowSampling(
            params=req.params, seed=req.seed, position=req.num_tokens,
            banned_ids=tuple(req.stop_token_ids) if held_back else (),
            penalty_slot=self.penalty_slots.slot(req) if req.params.has_penalties else -1,
        )

    def _fill_tables(self, chunks: list[ScheduledChunk], rows: int, width: int) -> np.ndarray:
        tables = np.zeros((rows, width), np.int32)
        for i, c in enumerate(chunks):
            n = min(len(c.block_table), width)
            tables[i, :n] = c.block_table[:n]
        return tables

    def _sampling(self, chunks: list[ScheduledChunk], rows: int) -> SamplingTensors:
        row_params = [self._row_sampling(c) for c in chunks] + [None] * (rows - len(chunks))
        return SamplingTensors.build(row_params, rows, self.penalty_slots.spare, self._device_constant)

    def _device_constant(self, shape: tuple[int, ...], dtype: np.dtype, fill: object) -> jax.Array:
        """A filled array kept on the devices (sampling tables no row of a step uses), so that
        steps do not ship them from the host."""
        key = (shape, np.dtype(dtype).str, fill)
        array = self._constants.get(key)
        if array is None:
            array = self._constants[key] = jax.device_put(np.full(shape, fill, dtype), replicated(self.mesh))
        return array

    @staticmethod
    def _pending_input(chunk: ScheduledChunk, prev_rows: dict[Request, int]) -> int:
        """Row of the previous iteration's sampled buffer holding this chunk's last input token,
        when that token is still a PLACEHOLDER (the step that samples it has not been read)."""
        out = chunk.request.output_token_ids
        if chunk.sample and out and out[-1] == PLACEHOLDER:
            return prev_rows[chunk.request]
        return -1

    def _decode_arrays(self, chunks: list[ScheduledChunk], batch: int, width: int,
                       prev_rows: dict[Request, int] | None = None) -> tuple:
        bs = self.engine_config.block_size
        tokens = np.zeros(batch, np.int32)
        token_src = np.full(batch, -1, np.int32)
        positions = np.zeros(batch, np.int32)
        slots = np.zeros(batch, np.int32)
        seq_lens = np.zeros(batch, np.int32)
        tables = self._fill_tables(chunks, batch, width)
        for i, c in enumerate(chunks):
            faults.check("input", c.request)
            tokens[i] = c.request.last_token_id  # a decode computes the newest token
            token_src[i] = self._pending_input(c, prev_rows)
            positions[i] = c.start
            slots[i] = tables[i, c.start // bs] * bs + c.start % bs
            seq_lens[i] = c.start + 1
        meta = AttentionMetadata(slots, tables, seq_lens)
        host_args = (tokens, positions, meta, np.arange(batch, dtype=np.int32), token_src)
        return ("decode", batch, width), host_args, self._sampling(chunks, self._sampler_rows(batch)), self.decode_offset

    def _prefill_arrays(self, chunks: list[ScheduledChunk], num_tokens: int, num_seqs: int, width: int,
                        prev_rows: dict[Request, int] | None = None) -> tuple:
        bs = self.engine_config.block_size
        tokens = np.zeros(num_tokens, np.int32)
        token_src = np.full(num_tokens, -1, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        slots = np.zeros(num_tokens, np.int32)
        seq_lens = np.zeros(num_seqs, np.int32)
        query_start = np.zeros(num_seqs + 1, np.int32)
        logits_indices = np.zeros(num_seqs, np.int32)
        tables = self._fill_tables(chunks, num_seqs, width)
        row = 0
        for i, c in enumerate(chunks):
            faults.check("input", c.request)
            n = c.num_new_tokens
            pos = np.arange(c.start, c.start + n)
            tokens[row:row + n] = c.token_ids
            token_src[row + n - 1] = self._pending_input(c, prev_rows)
            positions[row:row + n] = pos
            slots[row:row + n] = tables[i, pos // bs] * bs + pos % bs
            seq_lens[i] = c.start + n
            row += n
            query_start[i + 1] = row
            logits_indices[i] = row - 1
        query_start[len(chunks) + 1:] = row
        meta = AttentionMetadata(slots, tables, seq_lens, query_start)
        host_args = (tokens, positions, meta, logits_indices, token_src)
        return ("prefill", num_tokens, num_seqs, width), host_args, self._sampling(chunks, self._sampler_rows(num_seqs)), 0

    # ----- execution ------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> tuple[list[Request], list[tuple], list[tuple]]:
        """An iteration's host arrays: the requests whose penalty rows are set first and those
        resets' arguments, then one tuple (key, host_args, sampling, offset) per program (prefill,
        then decode). Host work only: it raises for a request whose inputs cannot be built before
        anything reaches the device."""
        t0 = time.perf_counter()
        ec = self.engine_config
        prev_rows = self._sampled_rows
        programs = []
        slots = self.penalty_slots
        slots.release_finished()
        penalised = [c.request for c in sched.prefills + sched.decodes if c.sample and c.request.params.has_penalties]
        for req in penalised:
            slots.join(req)
        unset = [req for req in penalised if req in slots.unset]
        resets = [self._penalty_reset(unset[i:i + PENALTY_RESET_ROWS], prev_rows)
                  for i in range(0, len(unset), PENALTY_RESET_ROWS)]
        if sched.prefills:
            chunks = sched.prefills
            programs.append(self._prefill_arrays(
                chunks,
                bucket_for(sum(c.num_new_tokens for c in chunks), ec.prefill_token_buckets),
                bucket_for(len(chunks), ec.prefill_seq_buckets),
                self._width_bucket(chunks),
                prev_rows,
            ))
        if sched.decodes:
            chunks = sched.decodes
            programs.append(self._decode_arrays(
                chunks, bucket_for(len(chunks), ec.decode_batch_buckets), self._width_bucket(chunks), prev_rows
            ))
        self.last_prepare_time = time.perf_counter() - t0
        return unset, resets, programs

    def _penalty_reset(self, requests: list[Request], prev_rows: dict[Request, int]) -> tuple[np.ndarray, ...]:
        """Arguments of a penalty-row reset for up to PENALTY_RESET_ROWS requests' slots: slots,
        histories so far, which of their tokens are generated, and for a history whose last token
        is still in flight, its row in the previous iteration's sampled tokens and its index."""
        length, rows = self.engine_config.max_model_len, PENALTY_RESET_ROWS
        slots, token_src, token_index = np.full(rows, -1, np.int32), np.full(rows, -1, np.int32), np.zeros(rows, np.int32)
        history = np.full((rows, length), -1, np.int32)
        is_output = np.zeros((rows, length), np.bool_)
        for i, req in enumerate(requests):
            slots[i] = self.penalty_slots.slot(req)
            history[i], is_output[i] = penalty_history(req.prompt_token_ids, req.output_token_ids, req.params, length)
            if req.output_token_ids[-1:] == [PLACEHOLDER]:
                token_src[i] = prev_rows[req]
                token_index[i] = int(np.flatnonzero(is_output[i])[-1])
        return slots, history, is_output, token_src, token_index

    def launch(self, sched: SchedulerOutput, prepared: tuple[list[Request], list[tuple], list[tuple]]) -> StepHandle:
        """Dispatch a prepared iteration (block moves, then its steps with their sampling) without
        waiting for the device. Inputs that are placeholders of the previous iteration are read
        from its sampled tokens on the device."""
        t0 = time.perf_counter()
        self._move_blocks(sched)
        parts = [chunks for chunks in (sched.prefills, sched.decodes) if chunks]
        rows = {}
        unset, resets, programs = prepared
        outs = self._run_steps(resets, programs)
        self.penalty_slots.unset.difference_update(unset)
        for chunks, (*_, offset) in zip(parts, programs):
            rows.update((c.request, offset + i) for i, c in enumerate(chunks) if c.sample)
        self._sampled_rows = rows
        self.num_launches += 1
        handle = StepHandle(self.num_launches, [])
        for chunks, out in zip(parts, outs):
            wanted = max((c.request.params.logprobs for c in chunks
                          if c.sample and c.request.params.logprobs is not None), default=None)
            fields = (out.tokens,) if wanted is None else (out.tokens, out.logprobs) if wanted == 0 else tuple(out)
            for field in fields:
                field.copy_to_host_async()
            handle.parts.append((chunks, fields))
        self.last_launch_time = time.perf_counter() - t0
        return handle

    def fetch(self, handle: StepHandle) -> list[tuple[ScheduledChunk, SampledToken]]:
        """Wait for a launched iteration and read the token (and log-probabilities, if asked) that
        each of its sampling chunks produced."""
        t0 = time.perf_counter()
        handle.launches_before_fetch = self.num_launches
        results = []
        for chunks, fields in handle.parts:
            tokens, *rest = (np.asarray(f) for f in fields)
            logprobs = rest[0] if rest else None
            top_ids, top_logprobs = rest[1:] if len(rest) == 3 else (_NO_TOP_IDS, _NO_TOP_LOGPROBS)
            for i, c in enumerate(chunks):
                if c.sample:
                    lp = float(logprobs[i]) if logprobs is not None else float("nan")
                    ids, lps = (top_ids[i], top_logprobs[i]) if len(rest) == 3 else (top_ids, top_logprobs)
                    results.append((c, SampledToken(int(tokens[i]), lp, ids, lps)))
        self.last_fetch_time = time.perf_counter() - t0
        return results

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        """Execute the KV manager's copy plan, stage by stage, in order."""
        for stage in sched.copy_stages:
            for i in range(0, len(stage), BLOCK_MOVE_CHUNK):
                op = ("move", stage.kind, stage.src[i:i + BLOCK_MOVE_CHUNK], stage.dst[i:i + BLOCK_MOVE_CHUNK])
                if self.mirror is not None:
                    self.mirror(op)
                self._move(*op[1:])

    def _move(self, kind: CopyKind, src: list[int], dst: list[int]) -> None:
        """Move up to BLOCK_MOVE_CHUNK blocks. Host copies hold, on each process, the kv heads of
        its own devices' shards (all heads in one process), so swapping works across hosts."""
        if kind is CopyKind.DEVICE_TO_DEVICE:
            self.cache = self._copy(self.cache, _padded(src), _padded(dst))
        elif kind is CopyKind.DEVICE_TO_HOST:
            k, v = self._gather(self.cache, _padded(src))
            for host, blocks in ((self.host_k, k), (self.host_v, v)):
                for shard in blocks.addressable_shards:
                    host[shard.index][:, :, dst] = np.asarray(shard.data)[:, :, : len(src)]
        else:  # host -> device; padding rows rewrite block 0, which no sequence reads
            shape = self.host_k.shape[:2] + (BLOCK_MOVE_CHUNK,) + self.host_k.shape[3:]
            blocks = []
            for host in (self.host_k, self.host_v):
                chunk = np.zeros(shape, self.dtype)
                chunk[:, :, : len(src)] = host[:, :, src]
                blocks.append(jax.make_array_from_callback(shape, self.cache_sharding, chunk.__getitem__))
            self.cache = self._scatter(self.cache, _padded(dst), *blocks)

    def replay(self, op: tuple) -> None:
        """Run a device operation that process 0's runner passed to its `mirror` (multi-host:
        every process must launch the same computations in the same order)."""
        if op[0] == "steps":
            self._run_steps(op[1], op[2])
        elif op[0] == "move":
            self._move(*op[1:])
        else:
            raise ValueError(f"unknown mirrored operation {op[0]!r}")


_NO_TOP_IDS = np.zeros(0, np.int32)
_NO_TOP_LOGPROBS = np.zeros(0, np.float32)


def _padded(ids: list[int]) -> np.ndarray:
    out = np.zeros(BLOCK_MOVE_CHUNK, np.int32)
    out[: len(ids)] = ids
    return out
