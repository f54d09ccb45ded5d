"""The functions the runner's programs run (`programs.py` declares how each is compiled): one model
step, a decode step that samples in the same program, the sampler, prompt scoring, speculative
verification, a multi-step decode loop and the penalty-row reset. Pure functions of their
arguments, bound to one model and mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from jaxserve.model import AttentionMetadata, DecoderModel
from jaxserve.model.head import final_norm, head_logits
from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.step_counters import StepCounters
from jaxserve.sampler import SamplerOutput, sample
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sampling_tensors import set_penalty_rows
from jaxserve.speculative.verify import verify
from sharding.rules import logits_sharding, replicated


class StepFunctions:
    def __init__(
        self,
        model: DecoderModel,
        config: ModelConfig,
        mesh: Mesh,
        block_size: int,
        sampler_rows: Callable[[int], int],
        pool_segments: int,
    ) -> None:
        self.model = model
        self.config = config
        self.mesh = mesh
        self.block_size = block_size
        self.sampler_rows = sampler_rows  # the sampler's row bucket of a step's logits rows
        self.pool_segments = pool_segments  # embedding requests a prefill step pools for, at most

    def model_step(self, params, cache, inputs: HostPack, prev_sampled, pad_logits: bool = True):
        """Logits at `logits_indices` (padded to the sampler's row bucket unless `pad_logits` is
        off; padding rows are zeros), the updated cache, every row's last hidden state (for
        `score`), and the step's `StepCounters` (expert load, pipeline schedule)."""
        tokens, positions, meta, logits_indices, token_src = inputs.unpack()
        # Rows whose token the previous step sampled (a PLACEHOLDER on the host) read it here.
        tokens = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], tokens)
        (logits, cache), state = self.model.apply(
            {"params": params},
            tokens,
            positions,
            cache,
            meta,
            logits_indices,
            params.get("lora"),
            mutable=["intermediates"],
        )
        rows = logits.shape[0]
        if pad_logits:
            logits = jnp.pad(logits, ((0, self.sampler_rows(rows) - rows), (0, 0)))
        intermediates = state["intermediates"]
        load = (
            jnp.sum(intermediates["expert_load"][0], axis=0)
            if "expert_load" in intermediates
            else jnp.zeros(0, jnp.int32)
        )
        ticks = (
            intermediates["pipeline_ticks"][0] if "pipeline_ticks" in intermediates else jnp.zeros((0, 0), jnp.int32)
        )
        return logits, cache, intermediates["hidden"][0], StepCounters(load, ticks)

    def decode_step(
        self, params, cache, inputs: HostPack, prev_sampled, sampling, sampled, offset, counts, sample_here
    ):
        """`model_step`, then, when `sample_here` (a device scalar), `sample_into` on its logits.
        Returns (logits, cache, hidden, step counters, sampler output, sampled buffer, counts); without
        sampling the buffer and counts are unchanged and the output is empty (a step with
        constrained rows: the sampler program samples its logits once their masks are written)."""
        logits, cache, hidden, counters = self.model_step(params, cache, inputs, prev_sampled)
        # Tensor parallel: each device computes its vocabulary's logits, then they are gathered
        # to every device and sampled as by the sampler program (without the first constraint XLA
        # may gather the head's weights instead).
        logits = lax.with_sharding_constraint(logits, logits_sharding(self.mesh, logits.shape))
        logits = lax.with_sharding_constraint(logits, replicated(self.mesh))

        def skip(logits, sampling, sampled, offset, counts):
            out = jax.eval_shape(sample, logits, sampling, counts)[0]
            return SamplerOutput(*(jnp.zeros(x.shape, x.dtype) for x in out)), sampled, counts

        out, sampled, counts = lax.cond(sample_here, self.sample_into, skip, logits, sampling, sampled, offset, counts)
        return logits, cache, hidden, counters, out, sampled, counts

    def score(self, params, hidden, inputs: HostPack):
        """Log-probability and rank of `targets[i]` under the logits of row `rows[i]`, and the
        MAX_LOGPROBS most likely tokens there (unprocessed logits, as vLLM's prompt_logprobs)."""
        rows, targets = inputs.unpack()
        logprobs = jax.nn.log_softmax(head_logits(self.config, params, hidden[rows]), axis=-1)
        target = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(logprobs > target[:, None], axis=1, dtype=jnp.int32)
        top_logprobs, top_ids = lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[1]))
        return target, rank, top_ids.astype(jnp.int32), top_logprobs

    def pool(self, params, hidden, segments: HostPack):
        """[pool_segments, hidden] f32: per segment, the sum of its rows' hidden states after the
        model's final norm (rows of segment `pool_segments` are dropped)."""
        num = self.pool_segments
        x = final_norm(self.config, params, hidden).astype(jnp.float32)
        return jax.ops.segment_sum(x, segments.unpack(), num_segments=num + 1)[:num]

    def multi_step(self, params, cache, inputs: HostPack, sampling, prev_sampled, counts, loop_steps: int):
        """`loop_steps` decode steps of a batch in one loop (`StepInputs.multi_decode`): each
        step writes the rows' K/V, samples their next tokens and feeds them to the next step.
        Row i's tokens are [B, loop_steps], -1 after its `num_steps[i]` steps or after a stop token
        it sampled; its log-probabilities are by row i * loop_steps + step. Past its steps a row
        writes into block 0 (never allocated) and attends to nothing."""
        tokens, positions, tables, num_steps, stop_ids, token_src = inputs.unpack()
        bs = self.block_size
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
    def sample_into(logits, sampling, sampled, offset, counts):
        """Sample, and also write the tokens into this iteration's `sampled` buffer at `offset`."""
        out, counts = sample(logits, sampling, counts)
        return out, lax.dynamic_update_slice(sampled, out.tokens, (offset,)), counts

    @staticmethod
    def verify_drafts(logits, sampling, counts, drafts: HostPack):
        """`verify`, its drafts and their histories packed."""
        return verify(logits, sampling, counts, *drafts.unpack())

    @staticmethod
    def reset_penalty_rows(counts, inputs: HostPack, prev_sampled):
        """set_penalty_rows, after the history token at `token_index` of each row whose
        `token_src` >= 0 (a placeholder on the host) is read from the previous iteration."""
        slots, history, is_output, token_src, token_index = inputs.unpack()
        rows = jnp.arange(history.shape[0])
        pending = jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], history[rows, token_index])
        return set_penalty_rows(counts, slots, history.at[rows, token_index].set(pending), is_output)
