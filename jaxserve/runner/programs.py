"""The runner's jitted programs, each declared once: the pure function it runs (`step_functions`:
`(state, inputs) -> (state, outputs)`), its arguments (where each lies on the mesh; the state is
donated: updated in place), where its outputs go, and its variants (the buckets it is compiled for,
with example arguments of each). Warm-up compiles every variant of every declaration; serving runs
a variant by its bucket, and a bucket not compiled at warm-up is compiled then, and counted
(`Executables.num_compilations`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.runner.device_state import DeviceState
from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.inputs import StepInputs
from jaxserve.runner.prepared_step import Program
from jaxserve.runner.program_args import ProgramArgs
from jaxserve.runner.step_functions import StepFunctions

Bucket = tuple  # a variant's shape key, e.g. (batch, block-table width)


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    sharding: Any


def _on_split_state(fn: Callable) -> Callable:
    """`fn(state, *inputs) -> (state, outputs)` as the compiled call takes and gives the state:
    the parameters, then the updatable part (donated), then the inputs; it returns the updated
    part and the outputs."""

    def program(params: Any, updated: tuple, *inputs: Any) -> tuple[tuple, Any]:
        state, outputs = fn(DeviceState(params, *updated), *inputs)
        if state.params is not params:
            raise ValueError(f"{fn} changes the parameters: programs only read them")
        return state.updatable(), outputs

    return program


class ProgramSpec:
    """One declared program: `fn(state, *inputs) -> (state, outputs)`. `variants()` yields (bucket,
    example arguments: the state, then the inputs) for warm-up; a bucket may come more than once
    (the first one's arguments are compiled)."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        state: DeviceState,
        inputs: Sequence[Arg],
        outs: Any,
        variants: Callable[[], Iterable[tuple[Bucket, tuple]]],
    ) -> None:
        self.name = name
        self.inputs = tuple(inputs)
        self.variants = variants
        self.jitted = jax.jit(
            _on_split_state(fn),
            donate_argnums=(1,),
            in_shardings=(state.params, state.updatable(), *(a.sharding for a in self.inputs)),
            out_shardings=(state.updatable(), outs),
        )

    def lower(self, state: DeviceState, *inputs: Any) -> jax.stages.Lowered:
        return self.jitted.lower(state.params, state.updatable(), *inputs)

    def key(self, bucket: Bucket) -> tuple:
        """The executable's key: the program's name, then its bucket."""
        return (self.name, *bucket)

    def __repr__(self) -> str:
        return f"ProgramSpec({self.name}: state (donated but the parameters), {', '.join(a.name for a in self.inputs)})"


@dataclasses.dataclass(frozen=True)
class ProgramSetting:
    """What the declarations are built from: the functions, the engine's buckets, the host side's
    example programs, the argument builders, and the state (an example of it, and its shardings)."""

    functions: StepFunctions
    config: EngineConfig
    inputs: StepInputs
    args: ProgramArgs
    state: DeviceState
    state_shardings: DeviceState
    replicated: Any


class _Variants:
    """The example programs and arguments of each declaration's variants (what warm-up compiles)."""

    def __init__(self, s: ProgramSetting) -> None:
        self.s = s
        self.widths = s.config.block_table_buckets

    def decodes(self) -> Iterator[Program]:
        ec = self.s.config
        return (self.s.inputs.decode([], b, w) for w in self.widths for b in ec.decode_batch_buckets)

    def prefills(self) -> Iterator[Program]:
        ec = self.s.config
        return (
            self.s.inputs.prefill([], t, n, w)
            for w in self.widths
            for t in ec.prefill_token_buckets
            for n in ec.prefill_seq_buckets
        )

    def verifies(self) -> Iterator[Program]:
        return (self.s.inputs.verify([], b, w) for w in self.widths for b in self.s.inputs.verify_batches)

    def steps(self, programs: Callable[[], Iterator[Program]]) -> Callable[[], Iterator[tuple[tuple, tuple]]]:
        return lambda: ((p.key[1:], (self.s.state, *self.s.args.step(p))) for p in programs())

    def logits_of(self, program: Program) -> jax.ShapeDtypeStruct:
        rows = program.sampling.temperature.shape[0]
        return jax.ShapeDtypeStruct((rows, self.s.functions.config.vocab_size), jnp.float32)

    def samplers(self) -> Iterator[tuple[tuple, tuple]]:  # the row buckets of the steps' logits
        for p in itertools.chain(self.decodes(), self.prefills()):
            yield (p.sampling.temperature.shape[0],), (self.s.state, *self.s.args.sample(p, self.logits_of(p)))

    def verify_samplers(self) -> Iterator[tuple[tuple, tuple]]:
        for p in self.verifies():
            yield (p.sampling.temperature.shape[0],), (self.s.state, *self.s.args.verify(p, self.logits_of(p)))

    def by_tokens(self, host_rows: Callable[[np.ndarray], Any]) -> Callable[[], Iterator[tuple[tuple, tuple]]]:
        """Variants by a prefill step's token bucket: its hidden states and host rows of each."""
        f = self.s.functions

        def variants() -> Iterator[tuple[tuple, tuple]]:
            for tokens in self.s.config.prefill_token_buckets:
                hidden = jax.ShapeDtypeStruct((tokens, f.config.hidden_size), f.model.compute_dtype)
                yield (tokens,), (self.s.state, hidden, HostPack.of(host_rows(np.zeros(tokens, np.int32))))

        return variants

    def multi_decodes(self) -> Iterator[tuple[tuple, tuple]]:
        ec = self.s.config
        if ec.num_scheduler_steps > 1:
            for w in self.widths:
                for b in ec.decode_batch_buckets:
                    yield (b, w), (self.s.state, *self.s.args.multi_step(self.s.inputs.multi_decode([], b, w)))

    def penalty_resets(self) -> list[tuple[tuple, tuple]]:
        return [((), (self.s.state, *self.s.args.penalty_reset(self.s.inputs.penalty_reset([]))))]

    def lora_writes(self) -> list[tuple[tuple, tuple]]:
        return [((), (self.s.state, *self.s.args.lora_write(0, None)))]


def declare_programs(s: ProgramSetting) -> dict[str, ProgramSpec]:
    """Every program the runner runs, with the variants warm-up compiles.

    Explicit shardings on every program: the state as it lies (the cache split over kv heads),
    host inputs replicated, logits gathered to the full vocabulary once. Each program takes its
    host arrays packed in one buffer: a `HostPack`, or for the sampling settings their
    SamplingTensors array (its tables are often device constants).
    """
    specs = _model_programs(s, _Variants(s)) + _sampler_programs(s, _Variants(s))
    return {spec.name: spec for spec in specs}


def _model_programs(s: ProgramSetting, v: _Variants) -> list[ProgramSpec]:
    f, rep = s.functions, s.replicated
    st, host, outs = s.state_shardings, Arg("inputs", rep), rep
    sampling, offset = Arg("sampling", rep), Arg("sample_offset", rep)
    return [
        # A decode step samples in the same program (one dispatch per decode iteration); its
        # logits are an output too, for the sampler program of a step with constrained rows.
        ProgramSpec(
            "decode", f.decode_step, st, [host, sampling, offset, Arg("sample_here", rep)], outs, v.steps(v.decodes)
        ),
        # A prefill step (chunks, and the decodes that join them) leaves sampling to the sampler
        # program: a dispatch is nothing next to its device time, and each of its many shapes
        # would compile the sampler again (~1 s each on CPU).
        ProgramSpec("prefill", f.model_step, st, [host], outs, v.steps(v.prefills)),
        # Speculative decoding: verify steps keep every row's logits (no padding to a sampler
        # bucket); their sampler (`verify_sample`) accepts or rejects the drafts.
        ProgramSpec("verify", functools.partial(f.model_step, pad_logits=False), st, [host], outs, v.steps(v.verifies)),
        # Multi-step decode: the whole loop (model steps and their sampling) is one program.
        ProgramSpec(
            "multi_decode",
            functools.partial(f.multi_step, loop_steps=s.config.num_scheduler_steps),
            st,
            [host, sampling],
            outs,
            v.multi_decodes,
        ),
    ]


def _sampler_programs(s: ProgramSetting, v: _Variants) -> list[ProgramSpec]:
    f, rep = s.functions, s.replicated
    st, host, outs = s.state_shardings, Arg("inputs", rep), rep
    logits, sampling, hidden = Arg("logits", rep), Arg("sampling", rep), Arg("hidden", rep)
    specs = [
        # The sampler of prefill steps and of decode steps with constrained rows (dispatched once
        # their masks are written, after the step, whose work they overlap), by its row bucket.
        ProgramSpec("sample", f.sample_into, st, [logits, sampling, Arg("sample_offset", rep)], outs, v.samplers),
        ProgramSpec(
            "verify_sample", f.verify_drafts, st, [logits, sampling, Arg("drafts", rep)], outs, v.verify_samplers
        ),
        # Prompt log-probabilities: scores of a prefill step's rows from its hidden states, by
        # the step's token bucket (only steps that score a prompt run it).
        ProgramSpec("score", f.score, st, [hidden, host], outs, v.by_tokens(lambda rows: (rows, rows))),
        # Embeddings: sums of a prefill step's pooled rows of hidden states, after the final
        # norm, by the step's token bucket too (only steps that pool run it).
        ProgramSpec("pool", f.pool, st, [hidden, host], outs, v.by_tokens(lambda rows: rows)),
        # The penalty counts of requests that just got a batch row, from their histories.
        ProgramSpec("penalty_reset", f.reset_penalty_rows, st, [host], outs, v.penalty_resets),
    ]
    if s.args.lora_slots is not None:
        # LoRA: an adapter written into a LoRA slot (one shape for every adapter and LoRA slot).
        adapter = Arg("adapter", s.args.lora_slots.adapter_shardings)
        specs.append(
            ProgramSpec("lora_write", f.write_lora_slot, st, [Arg("lora_slot", rep), adapter], outs, v.lora_writes)
        )
    return specs
