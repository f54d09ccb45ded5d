"""The functions the runner's programs run (`programs.py` declares how each is compiled): one model
step, a decode step that samples in the same program, the sampler, prompt scoring, pooling,
speculative verification, a multi-step decode loop, the penalty-row reset and a LoRA slot write.
Each is a pure function `(state, inputs) -> (state, outputs)` of the runner's `DeviceState`,
bound to one model and mesh; the outputs are named (`program_outputs`), or None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from checkpoints.config import ModelConfig
from jaxserve.model import AttentionMetadata, DecoderModel
from jaxserve.model.head import final_norm, head_logits
from jaxserve.runner.device_state import DeviceState, SamplerState
from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.lora_slots import write_adapter
from jaxserve.runner.program_outputs import DecodeStepOutputs, ModelStepOutputs, PooledSums, PromptScoreOutputs
from jaxserve.runner.step_counters import StepCounters
from jaxserve.sampler import SamplerOutput, sample
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sampling_tensors import set_penalty_rows
from jaxserve.speculative.verify import VerifyOutput, verify
from sharding.rules import logits_sharding, replicated


def _sample_into(sampler: SamplerState, logits, sampling, offset) -> tuple[SamplerState, SamplerOutput]:
    """Sample, and write the tokens into this iteration's sampled buffer at `offset`."""
    out, counts = sample(logits, sampling, sampler.penalty_counts)
    sampled = lax.dynamic_update_slice(sampler.sampled, out.tokens, (offset,))
    return dataclasses.replace(sampler, penalty_counts=counts, sampled=sampled), out


def _pending_tokens(prev_sampled: jax.Array, tokens: jax.Array, token_src: jax.Array) -> jax.Array:
    """Rows whose token the previous iteration sampled (a PLACEHOLDER on the host) read it here."""
    return jnp.where(token_src >= 0, prev_sampled[jnp.maximum(token_src, 0)], tokens)


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

    def model_step(
        self, state: DeviceState, inputs: HostPack, pad_logits: bool = True
    ) -> tuple[DeviceState, ModelStepOutputs]:
        """Logits at `logits_indices` (padded to the sampler's row bucket unless `pad_logits` is
        off; padding rows are zeros), every row's last hidden state (for `score` and `pool`), and
        the step's `StepCounters` (expert load, pipeline schedule); the K/V written."""
        tokens, positions, meta, logits_indices, token_src, *images = inputs.unpack()  # images: a VLM's prefill
        tokens = _pending_tokens(state.sampler.prev_sampled, tokens, token_src)
        params = state.params
        (logits, cache), variables = self.model.apply(
            {"params": params},
            tokens,
            positions,
            state.cache,
            meta,
            logits_indices,
            state.adapters,
            images[0] if images else None,
            mutable=["intermediates"],
        )
        rows = logits.shape[0]
        if pad_logits:
            logits = jnp.pad(logits, ((0, self.sampler_rows(rows) - rows), (0, 0)))
        found = variables["intermediates"]
        load = jnp.sum(found["expert_load"][0], axis=0) if "expert_load" in found else jnp.zeros(0, jnp.int32)
        ticks = found["pipeline_ticks"][0] if "pipeline_ticks" in found else jnp.zeros((0, 0), jnp.int32)
        hidden = found["hidden"][0]
        aux = found["aux_hidden"][0] if "aux_hidden" in found else jnp.zeros((hidden.shape[0], 0), hidden.dtype)
        return state.with_cache(cache), ModelStepOutputs(logits, hidden, StepCounters(load, ticks), aux)

    def decode_step(
        self, state: DeviceState, inputs: HostPack, sampling, offset, sample_here
    ) -> tuple[DeviceState, DecodeStepOutputs]:
        """`model_step`, then, when `sample_here` (a device scalar), the sampler on its logits.
        Without sampling the sampler state is unchanged and the sampler output empty (a step with
        constrained rows: the sampler program samples its logits once their masks are written)."""
        state, step = self.model_step(state, inputs)
        # Tensor parallel: each device computes its vocabulary's logits, then they are gathered
        # to every device and sampled as by the sampler program (without the first constraint XLA
        # may gather the head's weights instead).
        logits = lax.with_sharding_constraint(step.logits, logits_sharding(self.mesh, step.logits.shape))
        logits = lax.with_sharding_constraint(logits, replicated(self.mesh))

        def skip(sampler, logits, sampling, offset):
            out = jax.eval_shape(sample, logits, sampling, sampler.penalty_counts)[0]
            return sampler, SamplerOutput(*(jnp.zeros(x.shape, x.dtype) for x in out))

        sampler, out = lax.cond(sample_here, _sample_into, skip, state.sampler, logits, sampling, offset)
        return state.with_sampler(sampler), DecodeStepOutputs(logits, step.hidden, step.counters, step.aux_hidden, out)

    @staticmethod
    def sample_into(state: DeviceState, logits, sampling, offset) -> tuple[DeviceState, SamplerOutput]:
        """The sampler of a step's logits, its tokens written into the sampled buffer at `offset`."""
        sampler, out = _sample_into(state.sampler, logits, sampling, offset)
        return state.with_sampler(sampler), out

    def score(self, state: DeviceState, hidden, inputs: HostPack) -> tuple[DeviceState, PromptScoreOutputs]:
        """Log-probability and rank of `targets[i]` under the logits of row `rows[i]`, and the
        MAX_LOGPROBS most likely tokens there (unprocessed logits, as vLLM's prompt_logprobs)."""
        rows, targets = inputs.unpack()
        logprobs = jax.nn.log_softmax(head_logits(self.config, state.params, hidden[rows]), axis=-1)
        target = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
        rank = 1 + jnp.sum(logprobs > target[:, None], axis=1, dtype=jnp.int32)
        top_logprobs, top_ids = lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[1]))
        return state, PromptScoreOutputs(target, rank, top_ids.astype(jnp.int32), top_logprobs)

    def pool(self, state: DeviceState, hidden, segments: HostPack) -> tuple[DeviceState, PooledSums]:
        """Per segment, the sum of its rows' hidden states after the model's final norm (rows of
        segment `pool_segments` are dropped)."""
        num = self.pool_segments
        x = final_norm(self.config, state.params, hidden).astype(jnp.float32)
        return state, PooledSums(jax.ops.segment_sum(x, segments.unpack(), num_segments=num + 1)[:num])

    def multi_step(
        self, state: DeviceState, inputs: HostPack, sampling, loop_steps: int
    ) -> tuple[DeviceState, SamplerOutput]:
        """`loop_steps` decode steps of a batch in one loop (`StepInputs.multi_decode`): each
        step writes the rows' K/V, samples their next tokens and feeds them to the next step.
        Row i's tokens are [B, loop_steps], -1 after its `num_steps[i]` steps or after a stop token
        it sampled; its log-probabilities are by row i * loop_steps + step. Past its steps a row
        writes into block 0 (never allocated) and attends to nothing, and a hybrid's row reads and
        writes the reserved state slot 0, so its own state stays that after its last step."""
        tokens, positions, tables, num_steps, stop_ids, token_src, states = inputs.unpack()
        bs, params = self.block_size, state.params
        batch, width = tables.shape
        rows = jnp.arange(batch, dtype=jnp.int32)
        pad_rows = sampling.temperature.shape[0] - batch
        tokens = _pending_tokens(state.sampler.prev_sampled, tokens, token_src)

        def one_step(carry, step):
            cache, tokens, counts, done = carry
            live = step < num_steps
            pos = positions + step
            page = tables[rows, jnp.minimum(pos // bs, width - 1)]
            meta = AttentionMetadata(
                jnp.where(live, page * bs + pos % bs, 0),
                tables,
                jnp.where(live, pos + 1, 0),
                state_slots=None if states is None else jnp.where(live, states, 0),
            )
            logits, cache = self.model.apply({"params": params}, tokens, pos, cache, meta, rows)
            logits = jnp.pad(logits, ((0, pad_rows), (0, 0)))
            out, counts = sample(logits, sampling.at_positions(sampling.positions + step), counts)
            out = SamplerOutput(*(field[:batch] for field in out))
            emitted = jnp.where(live & ~done, out.tokens, -1)
            done |= jnp.any(out.tokens[:, None] == stop_ids, axis=1)
            return (cache, out.tokens, counts, done), out._replace(tokens=emitted)

        init = (state.cache, tokens, state.sampler.penalty_counts, jnp.zeros(batch, jnp.bool_))
        (cache, _, counts, _), outs = lax.scan(one_step, init, jnp.arange(loop_steps, dtype=jnp.int32))
        by_row = lambda x: jnp.swapaxes(x, 0, 1).reshape(batch * loop_steps, *x.shape[2:])  # noqa: E731
        out = SamplerOutput(outs.tokens.T, by_row(outs.logprobs), by_row(outs.top_ids), by_row(outs.top_logprobs))
        return state.with_cache(cache).with_counts(counts), out

    @staticmethod
    def verify_drafts(state: DeviceState, logits, sampling, drafts: HostPack) -> tuple[DeviceState, VerifyOutput]:
        """`verify`, its drafts and their histories packed."""
        out, counts = verify(logits, sampling, state.sampler.penalty_counts, *drafts.unpack())
        return state.with_counts(counts), out

    @staticmethod
    def reset_penalty_rows(state: DeviceState, inputs: HostPack) -> tuple[DeviceState, None]:
        """set_penalty_rows, after the history token at `token_index` of each row whose
        `token_src` >= 0 (a placeholder on the host) is read from the previous iteration."""
        batch_rows, history, is_output, token_src, token_index = inputs.unpack()
        rows = jnp.arange(history.shape[0])
        pending = _pending_tokens(state.sampler.prev_sampled, history[rows, token_index], token_src)
        history = history.at[rows, token_index].set(pending)
        counts = set_penalty_rows(state.sampler.penalty_counts, batch_rows, history, is_output)
        return state.with_counts(counts), None

    @staticmethod
    def write_lora_slot(state: DeviceState, lora_slot, adapter) -> tuple[DeviceState, None]:
        """An adapter written into its LoRA slot of the LoRA stacks."""
        return dataclasses.replace(state, adapters=write_adapter(state.adapters, lora_slot, adapter)), None
