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
import functools
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
from jaxserve.config import EngineConfig
from jaxserve.kv import CopyStage
from jaxserve.model import AttentionMetadata, KVCache, LlamaModel
from jaxserve.runner.block_moves import BLOCK_MOVE_CHUNK, BlockMover
from jaxserve.model.llama import final_norm, head_logits, pack_kernels, panel_kernels, unstack_layers
from jaxserve.outputs import SampledToken, TokenLogprob
from jaxserve.request import Request
from jaxserve.runner.host_heap import keep_freed_blocks
from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.inputs import PooledRows, PreparedStep, Program, PromptScores, StepInputs, write_token_masks
from jaxserve.sampler import PenaltyCounts, SamplerOutput, sample, set_penalty_rows
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.scheduler.output import ScheduledChunk, SchedulerOutput
from jaxserve.speculative.verify import verify
from kernels_pallas import cpu_matmul, default_attention_backend, get_attention_backend, shard_attention
from sharding.kv_heads import replicate_kv_heads
from sharding.mesh import make_mesh, plan_tensor_parallel
from sharding.rules import cache_sharding, layer_sharding, logits_sharding, param_shardings, replicated

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepHandle:
    """A launched iteration: for each of its programs, the chunks, their slots in the persistent
    batch and the sampler outputs the host will read (tokens; log-probabilities only when a
    chunk asked for them)."""

    launch_index: int  # 1 for the runner's first launch
    parts: list[tuple[list[ScheduledChunk], np.ndarray, tuple[jax.Array, ...]]]
    launches_before_fetch: int = 0  # set by fetch: > launch_index when the next one went first
    # The prefill program's scored prompt positions and their (logprob, rank, top ids, top logprobs).
    prompt_scores: tuple[list[PromptScores], tuple[jax.Array, ...]] | None = None
    # The prefill program's pooled rows (embeddings) and the sum of each segment's rows.
    pooled: tuple[list[PooledRows], jax.Array] | None = None


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
                "data_parallel_size > 1 runs one engine per replica; build them with jaxserve.data_parallel.make_engine"
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
        self.engine_config = engine_config = engine_config.for_model(config.max_position_embeddings)
        if jax.default_backend() == "cpu":
            keep_freed_blocks()  # each step's temporaries reuse the last one's pages (host_heap)
        if engine_config.compilation_cache_dir:
            enable_persistent_compilation_cache(engine_config.compilation_cache_dir)
        # Tensor parallel: heads split over "tp"; kv heads repeated where tp needs more of them,
        # so `self.config` (what the model and cache are built with) may have more kv heads.
        plan = plan_tensor_parallel(config.num_heads, config.num_kv_heads, engine_config.tensor_parallel_size)
        self.mesh = _runner_mesh(engine_config, mesh)
        self.config = config = dataclasses.replace(config, num_kv_heads=plan.served_kv_heads)
        self.dtype = jnp.dtype(engine_config.dtype)  # of the weights
        self.attention_backend = engine_config.attention_backend or default_attention_backend()
        attention = shard_attention(get_attention_backend(self.attention_backend), self.mesh, "tp")
        # One CPU device with f32 weights, the cpu backend and scanned layers: the layers' matmuls
        # read their layer of the stacked weights, stored in panels, in place, and the tied head is
        # a C++ kernel too (kernels_pallas/cpu_matmul.py).
        native_matmul = (self.attention_backend == "cpu" and self.dtype == jnp.float32 and self.mesh.size == 1
                         and not engine_config.unroll_layers)
        matmul = cpu_matmul.kernels() if native_matmul else None
        self.model = LlamaModel(config, attention, self.dtype, engine_config.unroll_layers, matmul)
        self.cache_dtype = self.model.compute_dtype  # of activations and the KV cache
        params = replicate_kv_heads(_cast_params(params, self.dtype), plan, config.head_dim)
        if self.model.packed:
            params = pack_kernels(params)
        if matmul is not None:
            params = panel_kernels(params, matmul)
        self.param_shardings = param_shardings(params, self.mesh)
        if engine_config.unroll_layers:
            params = unstack_layers(params, config.num_layers, lambda leaf, i: leaf[i])
            self.param_shardings = unstack_layers(self.param_shardings, config.num_layers, layer_sharding)
        self.params = jax.device_put(params, self.param_shardings)

        bs = engine_config.block_size
        tp = engine_config.tensor_parallel_size  # kv_cache_memory is per device
        self.num_blocks = engine_config.num_blocks or max(
            2, engine_config.kv_cache_memory * tp // KVCache.bytes_per_block(config, bs, self.cache_dtype)
        )
        self.cache_sharding = cache_sharding(self.mesh)
        self.cache = jax.jit(
            lambda: KVCache.zeros(config, self.num_blocks, bs, self.cache_dtype), out_shardings=self.cache_sharding
        )()
        rep, kv = replicated(self.mesh), self.cache_sharding
        self.num_host_slots = engine_config.num_host_slots(KVCache.bytes_per_block(config, bs, self.cache_dtype))
        self.blocks = BlockMover(self.cache, kv, rep, self.num_host_slots)
        self._constants: dict[tuple, jax.Array] = {}
        self.inputs = StepInputs(engine_config, self._device_constant, config.vocab_size)

        # Explicit shardings on every executable: host inputs replicated, logits gathered to the
        # full vocabulary once, the cache kept split over kv heads and donated.
        # Each executable takes its host arrays packed in one buffer: a `HostPack`, or for the
        # sampling settings their SamplingTensors array (its tables are often device constants).
        # A decode step samples in the same program (one dispatch per decode iteration); its
        # logits are an output too, for the sampler program of a step with constrained rows.
        self._decode_step = jax.jit(
            self._decode_step_fn, donate_argnums=(1, 7), in_shardings=(self.param_shardings, kv, *[rep] * 7),
            out_shardings=(rep, kv, rep, rep, rep, rep),
        )
        # A prefill step (chunks, and the decodes that join them) leaves sampling to `_sample`:
        # a dispatch is nothing next to its device time, and each of its many shapes would
        # compile the sampler again (~1 s each on CPU).
        self._step = jax.jit(
            self._model_step, donate_argnums=(1,), in_shardings=(self.param_shardings, kv, rep, rep),
            out_shardings=(rep, kv, rep),
        )
        # Prompt log-probabilities: scores of a prefill step's rows from its hidden states, keyed
        # by the step's token bucket (only steps that score a prompt run it).
        self._score = jax.jit(self._score_fn, in_shardings=(self.param_shardings, rep, rep), out_shardings=rep)
        # Embeddings: sums of a prefill step's pooled rows of hidden states, after the final norm,
        # keyed by the step's token bucket too (only steps that pool run it).
        self._pool = jax.jit(self._pool_fn, in_shardings=(self.param_shardings, rep, rep), out_shardings=rep)
        # The sampler of prefill steps and of decode steps with constrained rows (dispatched once
        # their masks are written, after the step, whose work they overlap). It is keyed by its
        # row bucket only, so it compiles a few times, not once per step shape. It updates the
        # penalty counts in place.
        self._sample = jax.jit(self._sample_fn, donate_argnums=(4,), in_shardings=rep, out_shardings=rep)
        # Speculative decoding: verify steps keep every row's logits (no padding to a sampler
        # bucket), and their sampler (keyed by its rows) accepts or rejects the drafts.
        self._verify_step = jax.jit(
            functools.partial(self._model_step, pad_logits=False), donate_argnums=(1,),
            in_shardings=(self.param_shardings, kv, rep, rep), out_shardings=(rep, kv, rep),
        )
        self._verify = jax.jit(self._verify_fn, donate_argnums=(2,), in_shardings=rep, out_shardings=rep)
        # Multi-step decode: the whole loop (model steps and their sampling) is one program.
        self._multi_step = jax.jit(
            functools.partial(self._multi_step_fn, loop_steps=engine_config.num_scheduler_steps),
            donate_argnums=(1, 5), in_shardings=(self.param_shardings, kv, *[rep] * 4), out_shardings=(rep, kv, rep),
        )
        self.penalty_counts = jax.jit(PenaltyCounts.zeros, static_argnums=(0, 1), out_shardings=rep)(
            engine_config.max_num_seqs, config.vocab_size)
        self._set_penalty_rows = jax.jit(self._set_penalty_rows_fn, donate_argnums=(0,), in_shardings=rep,
                                         out_shardings=rep)
        self._no_tokens = jax.device_put(np.zeros(self.inputs.sampled_rows, np.int32), rep)
        self._prev_sampled = self._no_tokens  # the last launched iteration's sampled tokens
        self.num_launches = 0
        self.last_prepare_time = self.last_launch_time = self.last_fetch_time = 0.0
        self._executables: dict[tuple, Any] = {}
        self.num_compilations = 0
        # Multi-host: on process 0, called with every device operation of serving (an iteration's
        # programs or a block move) before it runs, so the other processes can `replay` it.
        self.mirror: Callable[[tuple], None] | None = None

    # ----- the jitted functions -------------------------------------------------------------

    def _model_step(self, params, cache, inputs: HostPack, prev_sampled, pad_logits: bool = True):
        """Logits at `logits_indices` (padded to the sampler's row bucket unless `pad_logits` is
        off; padding rows are zeros), the updated cache, and every row's last hidden state (for
        `_score_fn`)."""
        tokens, positions, meta, logits_indices, token_src = inputs.unpack()
        # Rows whose token the previous step sampled (a PLACEHOLDER on the host) read it here.
        tokens = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], tokens)
        (logits, cache), state = self.model.apply(
            {"params": params}, tokens, positions, cache, meta, logits_indices, mutable=["intermediates"])
        rows = logits.shape[0]
        if pad_logits:
            logits = jnp.pad(logits, ((0, self.inputs.sampler_rows(rows) - rows), (0, 0)))
        return logits, cache, state["intermediates"]["hidden"][0]

    def _decode_step_fn(self, params, cache, inputs: HostPack, prev_sampled, sampling, sampled, offset, counts,
                        sample_here):
        """`_model_step`, then, when `sample_here` (a device scalar), `_sample_fn` on its logits.
        Returns (logits, cache, hidden, sampler output, sampled buffer, counts); without
        sampling the buffer and counts are unchanged and the output is empty (a step with
        constrained rows: `_sample` samples its logits once their masks are written)."""
        logits, cache, hidden = self._model_step(params, cache, inputs, prev_sampled)
        # Tensor parallel: each device computes its vocabulary's logits, then they are gathered
        # to every device and sampled as by `_sample` (without the first constraint XLA may
        # gather the head's weights instead).
        logits = lax.with_sharding_constraint(logits, logits_sharding(self.mesh, logits.shape))
        logits = lax.with_sharding_constraint(logits, replicated(self.mesh))

        def skip(logits, sampling, sampled, offset, counts):
            out = jax.eval_shape(sample, logits, sampling, counts)[0]
            return SamplerOutput(*(jnp.zeros(x.shape, x.dtype) for x in out)), sampled, counts

        out, sampled, counts = lax.cond(sample_here, self._sample_fn, skip, logits, sampling, sampled, offset, counts)
        return logits, cache, hidden, out, sampled, counts

    def _score_fn(self, params, hidden, inputs: HostPack):
        """Log-probability and rank of `targets[i]` under the logits of row `rows[i]`, and the
        MAX_LOGPROBS most likely tokens there (unprocessed logits, as vLLM's prompt_logprobs)."""
        rows, targets = inputs.unpack()
        logprobs = jax.nn.log_softmax(head_logits(self.config, params, hidden[rows]), axis=-1)
        target = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(logprobs > target[:, None], axis=1, dtype=jnp.int32)
        top_logprobs, top_ids = lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[1]))
        return target, rank, top_ids.astype(jnp.int32), top_logprobs

    def _pool_fn(self, params, hidden, segments: HostPack):
        """[pool_segments, hidden] f32: per segment, the sum of its rows' hidden states after the
        model's final norm (rows of segment `pool_segments` are dropped)."""
        num = self.inputs.pool_segments
        x = final_norm(self.config, params, hidden).astype(jnp.float32)
        return jax.ops.segment_sum(x, segments.unpack(), num_segments=num + 1)[:num]

    def _multi_step_fn(self, params, cache, inputs: HostPack, sampling, prev_sampled, counts, loop_steps: int):
        """`loop_steps` decode steps of a batch in one loop (`StepInputs.multi_decode`): each
        step writes the rows' K/V, samples their next tokens and feeds them to the next step.
        Row i's tokens are [B, loop_steps], -1 after its `num_steps[i]` steps or after a stop token
        it sampled; its log-probabilities are by row i * loop_steps + step. Past its steps a row
        writes into block 0 (never allocated) and attends to nothing."""
        tokens, positions, tables, num_steps, stop_ids, token_src = inputs.unpack()
        bs = self.engine_config.block_size
        batch, width = tables.shape
        rows = jnp.arange(batch, dtype=jnp.int32)
        pad_rows = sampling.temperature.shape[0] - batch
        tokens = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], tokens)

        def one_step(carry, step):
            cache, tokens, counts, done = carry
            live = step < num_steps
            pos = positions + step
            page = tables[rows, jnp.minimum(pos // bs, width - 1)]
            meta = AttentionMetadata(jnp.where(live, page * bs + pos % bs, 0), tables, jnp.where(live, pos + 1, 0))
            logits, cache = self.model.apply({"params": params}, tokens, pos, cache, meta, rows)
            logits = jnp.pad(logits, ((0, pad_rows), (0, 0)))
            out, counts = sample(logits, sampling.at_positions(sampling.positions + step), counts)
            out = SamplerOutput(*(field[:batch] for field in out))
            emitted = jnp.where(live & ~done, out.tokens, -1)
            done |= jnp.any(out.tokens[:, None] == stop_ids, axis=1)
            return (cache, out.tokens, counts, done), out._replace(tokens=emitted)

        init = (cache, tokens, counts, jnp.zeros(batch, jnp.bool_))
        (cache, _, counts, _), outs = lax.scan(one_step, init, jnp.arange(loop_steps, dtype=jnp.int32))
        by_row = lambda x: jnp.swapaxes(x, 0, 1).reshape(batch * loop_steps, *x.shape[2:])  # noqa: E731
        out = SamplerOutput(outs.tokens.T, by_row(outs.logprobs), by_row(outs.top_ids), by_row(outs.top_logprobs))
        return out, cache, counts

    @staticmethod
    def _sample_fn(logits, sampling, sampled, offset, counts):
        """Sample, and also write the tokens into this iteration's `sampled` buffer at `offset`."""
        out, counts = sample(logits, sampling, counts)
        return out, lax.dynamic_update_slice(sampled, out.tokens, (offset,)), counts

    @staticmethod
    def _verify_fn(logits, sampling, counts, drafts: HostPack):
        """`verify`, its drafts and their histories packed."""
        return verify(logits, sampling, counts, *drafts.unpack())

    @staticmethod
    def _set_penalty_rows_fn(counts, inputs: HostPack, prev_sampled):
        """set_penalty_rows, after the history token at `token_index` of each row whose
        `token_src` >= 0 (a placeholder on the host) is read from the previous iteration."""
        slots, history, is_output, token_src, token_index = inputs.unpack()
        rows = jnp.arange(history.shape[0])
        pending = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], history[rows, token_index])
        return set_penalty_rows(counts, slots, history.at[rows, token_index].set(pending), is_output)

    def _device_constant(self, shape: tuple[int, ...], dtype: np.dtype, fill: object) -> jax.Array:
        """A filled array kept on the devices (sampling tables no row of a step uses, the offsets
        of the sampled buffer), so that steps do not ship them from the host."""
        key = (shape, np.dtype(dtype).str, fill)
        array = self._constants.get(key)
        if array is None:
            array = self._constants[key] = jax.device_put(np.full(shape, fill, dtype), replicated(self.mesh))
        return array

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
            logits, self.cache, _ = self._compiled(program.key, self._step, args, warming_up)(*args)
            return logits
        logits, self.cache, _, _, _, self.penalty_counts = self._compiled(
            program.key, self._decode_step, args, warming_up)(*args)
        return logits

    def _multi_step_args(self, program: Program) -> tuple:
        return (self.params, self.cache, HostPack.of(program.host_args), program.sampling, self._prev_sampled,
                self.penalty_counts)

    def _sample_offset(self, program: Program) -> jax.Array:
        return self._device_constant((), np.int32, program.sample_offset)  # 0 or decode_offset: not shipped

    def _sample_args(self, program: Program, logits: Any, sampled: jax.Array) -> tuple:
        return (logits, program.sampling, sampled, self._sample_offset(program), self.penalty_counts)

    def _verify_args(self, program: Program, logits: Any) -> tuple:
        return (logits, program.sampling, self.penalty_counts, HostPack.of(program.drafts))

    def _reset_args(self, reset: tuple[np.ndarray, ...]) -> tuple:
        return (self.penalty_counts, HostPack.of(reset), self._prev_sampled)

    def warm_up(self) -> float:
        """Compile every bucket of both steps, the samplers and the penalty reset (and, with
        speculative decoding, the verify steps and their samplers; with multi-step decode, its
        loops); return the seconds it took.

        Tracing and lowering hold the GIL and run one by one on this thread; each lowered
        program goes straight to a pool of a thread per core, so XLA compiles the earlier
        variants while later ones are being traced.
        """
        ec = self.engine_config
        t0 = time.perf_counter()
        programs = [self.inputs.decode([], b, w) for w in ec.block_table_buckets for b in ec.decode_batch_buckets]
        programs += [self.inputs.prefill([], t, s, w) for w in ec.block_table_buckets
                     for t in ec.prefill_token_buckets for s in ec.prefill_seq_buckets]
        verifies = [self.inputs.verify([], b, w) for w in ec.block_table_buckets for b in self.inputs.verify_batches]
        multi_steps = [] if ec.num_scheduler_steps == 1 else [
            self.inputs.multi_decode([], b, w) for w in ec.block_table_buckets for b in ec.decode_batch_buckets]
        pending: dict[tuple, concurrent.futures.Future] = {}
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
            def submit(key: tuple, fn, args: tuple) -> None:
                if key not in self._executables and key not in pending:
                    pending[key] = pool.submit(fn.lower(*args).compile)

            for program in programs:
                submit(program.key, self._decode_step if program.is_decode else self._step, self.step_args(program))
                rows = program.sampling.temperature.shape[0]
                logits = jax.ShapeDtypeStruct((rows, self.config.vocab_size), jnp.float32)
                submit(("sample", rows), self._sample, self._sample_args(program, logits, self._no_tokens))
            for program in verifies:
                submit(program.key, self._verify_step, self.step_args(program))
                rows = program.sampling.temperature.shape[0]
                logits = jax.ShapeDtypeStruct((rows, self.config.vocab_size), jnp.float32)
                submit(("verify_sample", rows), self._verify, self._verify_args(program, logits))
            for program in multi_steps:
                submit(program.key, self._multi_step, self._multi_step_args(program))
            for tokens in ec.prefill_token_buckets:
                hidden = jax.ShapeDtypeStruct((tokens, self.config.hidden_size), self.cache_dtype)
                rows = np.zeros(tokens, np.int32)
                submit(("score", tokens), self._score, (self.params, hidden, HostPack.of((rows, rows))))
                submit(("pool", tokens), self._pool, (self.params, hidden, HostPack.of(rows)))
            submit(("penalty_reset",), self._set_penalty_rows, self._reset_args(self.inputs.penalty_reset([])))
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
            + (f"; verify (speculative, {self.inputs.verify_rows} rows per sequence) batch "
               f"{list(self.inputs.verify_batches)} x width {list(ec.block_table_buckets)}" if self.inputs.verify_rows else "")
            + (f"; multi-step decode ({ec.num_scheduler_steps} steps) batch {list(ec.decode_batch_buckets)} x width "
               f"{list(ec.block_table_buckets)}" if ec.num_scheduler_steps > 1 else "")
        )

    # ----- execution ------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """An iteration's host arrays (see `StepInputs.prepare`). Host work only: it raises for a
        request whose inputs cannot be built before anything reaches the device."""
        t0 = time.perf_counter()
        prepared = self.inputs.prepare(sched)
        self.last_prepare_time = time.perf_counter() - t0
        return prepared

    def launch(self, sched: SchedulerOutput, prepared: PreparedStep,
               before_masks: Callable[[], None] | None = None) -> StepHandle:
        """Dispatch a prepared iteration (block moves, then its steps with their sampling) without
        waiting for the device. Inputs that are placeholders of the previous iteration are read
        from its sampled tokens on the device. `before_masks` is called once, before the first
        grammar mask is written (after that program's model step is dispatched)."""
        t0 = time.perf_counter()
        self.move_blocks(sched.copy_stages)
        self.num_launches += 1  # a read from `before_masks` comes after this launch
        caller_seconds = []  # not the runner's time: `last_launch_time` leaves it out

        def timed_before_masks() -> None:
            start = time.perf_counter()
            before_masks()
            caller_seconds.append(time.perf_counter() - start)

        outs, scores, pooled = self._run_steps(prepared.penalty_resets, prepared.programs,
                                               before_masks=timed_before_masks if before_masks is not None else None)
        self.inputs.batch.unset.difference_update(prepared.reset_requests)
        # The tokens of decode and prefill programs land in the sampled buffer, at their offsets.
        self.inputs.batch.launched(self.num_launches, [
            (p.slots, p.sample_offset if p.drafts is None and p.num_steps == 1 else None) for p in prepared.programs])
        handle = StepHandle(self.num_launches, [])
        for chunks, program, out in zip(prepared.parts, prepared.programs, outs):
            wanted = max((c.request.params.logprobs for c in chunks
                          if c.sample and c.request.params.logprobs is not None), default=None)
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
        self.last_launch_time = time.perf_counter() - t0 - sum(caller_seconds)
        return handle

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
        self.last_fetch_time = time.perf_counter() - t0
        return results

    @staticmethod
    def fetch_prompt_scores(handle: StepHandle) -> list[tuple[Request, int, list[TokenLogprob]]]:
        """Wait for a launched iteration's prompt scores: for each request it scored, the first
        position and the scores of that position and the ones after it (with the request's
        `prompt_logprobs` most likely tokens)."""
        if handle.prompt_scores is None:
            return []
        scored, fields = handle.prompt_scores
        logprob, rank, top_ids, top_logprobs = (np.asarray(f) for f in fields)
        results = []
        for s in scored:
            k = s.request.params.prompt_logprobs
            rows = range(s.row, s.row + s.count)
            results.append((s.request, s.first, [
                TokenLogprob(s.request.prompt_token_ids[s.first + i], float(logprob[r]),
                             [(int(t), float(p)) for t, p in zip(top_ids[r, :k], top_logprobs[r, :k])], int(rank[r]))
                for i, r in enumerate(rows)]))
        return results

    @staticmethod
    def fetch_pooled(handle: StepHandle) -> list[tuple[Request, np.ndarray, int]]:
        """Wait for a launched iteration's pooled rows: for each embedding request it pooled for,
        the sum of those rows' final hidden states and their count."""
        if handle.pooled is None:
            return []
        pooled, sums = handle.pooled
        sums = np.asarray(sums)
        return [(p.request, sums[p.segment], len(p.positions)) for p in pooled]

    def _run_steps(self, penalty_resets: list[tuple], programs: list[Program], warming_up: bool = False,
                   before_masks: Callable[[], None] | None = None
                   ) -> tuple[list[SamplerOutput], tuple[jax.Array, ...] | None, jax.Array | None]:
        """Run one iteration: first the penalty rows of requests that just got a slot, then the
        programs (and the prompt scores and pooled rows of the one that has any). The sampled
        tokens land in a fresh buffer that becomes the next iteration's `prev_sampled`. A program's
        grammar masks are written while its model step runs (multi-host: before, for the
        followers' copy), after `before_masks()`."""
        pending = [before_masks] if before_masks is not None else []

        def write_masks(program: Program) -> Program:
            if program.masks and pending:
                pending.pop()()
            return write_token_masks(program)

        if self.mirror is not None and not warming_up:
            programs = [write_masks(p) for p in programs]
            self.mirror(("steps", penalty_resets, programs))
        for reset in penalty_resets:
            args = self._reset_args(reset)
            self.penalty_counts = self._compiled(("penalty_reset",), self._set_penalty_rows, args, warming_up)(*args)
        sampled, outs, scores, pooled = self._no_tokens, [], None, None
        for program in programs:
            if program.num_steps > 1:
                args = self._multi_step_args(program)
                out, self.cache, self.penalty_counts = self._compiled(
                    program.key, self._multi_step, args, warming_up)(*args)
                outs.append(out)
                continue
            if program.drafts is not None:
                args = self.step_args(program)
                logits, self.cache, _ = self._compiled(program.key, self._verify_step, args, warming_up)(*args)
                verify_args = self._verify_args(write_masks(program), logits)
                out, self.penalty_counts = self._compiled(
                    ("verify_sample", logits.shape[0]), self._verify, verify_args, warming_up)(*verify_args)
                outs.append(out)
                continue
            args = self.step_args(program, sampled)
            if program.is_decode:
                logits, self.cache, hidden, out, sampled, self.penalty_counts = self._compiled(
                    program.key, self._decode_step, args, warming_up)(*args)
            else:
                logits, self.cache, hidden = self._compiled(program.key, self._step, args, warming_up)(*args)
            if program.score is not None:
                score_args = (self.params, hidden, HostPack.of(program.score))
                scores = self._compiled(("score", hidden.shape[0]), self._score, score_args, warming_up)(*score_args)
            if program.pool is not None:
                pool_args = (self.params, hidden, HostPack.of(program.pool))
                pooled = self._compiled(("pool", hidden.shape[0]), self._pool, pool_args, warming_up)(*pool_args)
            if program.constrained or not program.is_decode:
                sample_args = self._sample_args(write_masks(program), logits, sampled)
                out, sampled, self.penalty_counts = self._compiled(
                    ("sample", logits.shape[0]), self._sample, sample_args, warming_up)(*sample_args)
            outs.append(out)
        self._prev_sampled = sampled
        return outs, scores, pooled

    def move_blocks(self, stages: list[CopyStage]) -> None:
        """Execute the KV manager's copy plan, stage by stage, in order (a step does it first)."""
        for stage in stages:
            for i in range(0, len(stage), BLOCK_MOVE_CHUNK):
                op = ("move", stage.kind, stage.src[i:i + BLOCK_MOVE_CHUNK], stage.dst[i:i + BLOCK_MOVE_CHUNK])
                if self.mirror is not None:
                    self.mirror(op)
                self.cache = self.blocks.move(self.cache, *op[1:])

    def replay(self, op: tuple) -> None:
        """Run a device operation that process 0's runner passed to its `mirror` (multi-host:
        every process must launch the same computations in the same order)."""
        if op[0] == "steps":
            self._run_steps(op[1], op[2])
        elif op[0] == "move":
            self.cache = self.blocks.move(self.cache, *op[1:])
        else:
            raise ValueError(f"unknown mirrored operation {op[0]!r}")


_NAN = float("nan")
_NO_TOP_IDS = np.zeros(0, np.int32)
_NO_TOP_LOGPROBS = np.zeros(0, np.float32)
