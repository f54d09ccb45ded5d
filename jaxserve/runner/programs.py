"""The runner's jitted programs, each declared once: the function it runs, its arguments (where each
lies on the mesh, and whether the program takes it over: donated, updated in place), where its
outputs go, and its variants (the buckets it is compiled for, with example arguments of each).
Warm-up compiles every variant of every declaration; serving runs a variant by its bucket, and a
bucket not compiled at warm-up is compiled then, and counted (`ModelRunner.num_compilations`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.host_pack import HostPack
from jaxserve.runner.lora_slots import write_slot
from jaxserve.runner.prepared_step import Program
from sharding.rules import replicated

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

Bucket = tuple  # a variant's shape key, e.g. (batch, block-table width)


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    sharding: Any
    donated: bool = False


class ProgramSpec:
    """One declared program. `variants()` yields (bucket, example arguments) for warm-up; a
    bucket may come more than once (the first one's arguments are compiled)."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        args: Sequence[Arg],
        outs: Any,
        variants: Callable[[], Iterable[tuple[Bucket, tuple]]],
    ) -> None:
        self.name = name
        self.args = tuple(args)
        self.variants = variants
        self.jitted = jax.jit(
            fn,
            donate_argnums=tuple(i for i, a in enumerate(self.args) if a.donated),
            in_shardings=tuple(a.sharding for a in self.args),
            out_shardings=outs,
        )

    def key(self, bucket: Bucket) -> tuple:
        """The executable's key: the program's name, then its bucket."""
        return (self.name, *bucket)

    def __repr__(self) -> str:
        args = ", ".join(a.name + (" (donated)" if a.donated else "") for a in self.args)
        return f"ProgramSpec({self.name}: {args})"


def declare_programs(runner: ModelRunner) -> dict[str, ProgramSpec]:
    """Every program the runner runs, with the variants warm-up compiles.

    Explicit shardings on every program: host inputs replicated, logits gathered to the full
    vocabulary once, the cache kept split over kv heads and donated. Each program takes its
    host arrays packed in one buffer: a `HostPack`, or for the sampling settings their
    SamplingTensors array (its tables are often device constants).
    """
    ec, f, inputs = runner.engine_config, runner.functions, runner.inputs
    rep = replicated(runner.mesh)
    params, host = Arg("params", runner.param_shardings), Arg("inputs", rep)
    cache = Arg("cache", runner.cache_sharding, donated=True)
    prev, counts, sampling = Arg("prev_sampled", rep), Arg("penalty_counts", rep, True), Arg("sampling", rep)
    logits, sampled, offset = Arg("logits", rep), Arg("sampled", rep), Arg("sample_offset", rep)
    step_outs = (rep, runner.cache_sharding, rep, rep)  # logits, cache, hidden states, StepCounters
    widths = ec.block_table_buckets

    def decodes() -> Iterator[Program]:
        return (inputs.decode([], b, w) for w in widths for b in ec.decode_batch_buckets)

    def prefills() -> Iterator[Program]:
        return (
            inputs.prefill([], t, n, w)
            for w in widths
            for t in ec.prefill_token_buckets
            for n in ec.prefill_seq_buckets
        )

    def verifies() -> Iterator[Program]:
        return (inputs.verify([], b, w) for w in widths for b in inputs.verify_batches)

    def steps(programs: Callable[[], Iterator[Program]]) -> Callable[[], Iterator[tuple[tuple, tuple]]]:
        return lambda: ((p.key[1:], runner.step_args(p)) for p in programs())

    def logits_of(program: Program) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((program.sampling.temperature.shape[0], runner.config.vocab_size), jnp.float32)

    def samplers() -> Iterator[tuple[tuple, tuple]]:  # the row buckets of the steps' logits
        for p in itertools.chain(decodes(), prefills()):
            yield (p.sampling.temperature.shape[0],), runner.sample_args(p, logits_of(p), runner._no_tokens)

    def hidden_states(tokens: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((tokens, runner.config.hidden_size), runner.cache_dtype)

    def scores() -> Iterator[tuple[tuple, tuple]]:
        for tokens in ec.prefill_token_buckets:
            rows = np.zeros(tokens, np.int32)
            yield (tokens,), (runner.params, hidden_states(tokens), HostPack.of((rows, rows)))

    def pools() -> Iterator[tuple[tuple, tuple]]:
        for tokens in ec.prefill_token_buckets:
            yield (tokens,), (runner.params, hidden_states(tokens), HostPack.of(np.zeros(tokens, np.int32)))

    def multi_decodes() -> Iterator[tuple[tuple, tuple]]:
        if ec.num_scheduler_steps > 1:
            for w in widths:
                for b in ec.decode_batch_buckets:
                    yield (b, w), runner.multi_step_args(inputs.multi_decode([], b, w))

    specs = [
        # A decode step samples in the same program (one dispatch per decode iteration); its
        # logits are an output too, for the sampler program of a step with constrained rows.
        ProgramSpec(
            "decode",
            f.decode_step,
            [params, cache, host, prev, sampling, sampled, offset, counts, Arg("sample_here", rep)],
            (*step_outs, rep, rep, rep),
            steps(decodes),
        ),
        # A prefill step (chunks, and the decodes that join them) leaves sampling to the sampler
        # program: a dispatch is nothing next to its device time, and each of its many shapes
        # would compile the sampler again (~1 s each on CPU).
        ProgramSpec("prefill", f.model_step, [params, cache, host, prev], step_outs, steps(prefills)),
        # The sampler of prefill steps and of decode steps with constrained rows (dispatched once
        # their masks are written, after the step, whose work they overlap), by its row bucket.
        ProgramSpec("sample", f.sample_into, [logits, sampling, sampled, offset, counts], rep, samplers),
        # Prompt log-probabilities: scores of a prefill step's rows from its hidden states, by
        # the step's token bucket (only steps that score a prompt run it).
        ProgramSpec("score", f.score, [params, Arg("hidden", rep), host], rep, scores),
        # Embeddings: sums of a prefill step's pooled rows of hidden states, after the final
        # norm, by the step's token bucket too (only steps that pool run it).
        ProgramSpec("pool", f.pool, [params, Arg("hidden", rep), host], rep, pools),
        # Speculative decoding: verify steps keep every row's logits (no padding to a sampler
        # bucket), and their sampler (by its rows) accepts or rejects the drafts.
        ProgramSpec(
            "verify",
            functools.partial(f.model_step, pad_logits=False),
            [params, cache, host, prev],
            step_outs,
            steps(verifies),
        ),
        ProgramSpec(
            "verify_sample",
            f.verify_drafts,
            [logits, sampling, counts, Arg("drafts", rep)],
            rep,
            lambda: (((p.sampling.temperature.shape[0],), runner.verify_args(p, logits_of(p))) for p in verifies()),
        ),
        # Multi-step decode: the whole loop (model steps and their sampling) is one program.
        ProgramSpec(
            "multi_decode",
            functools.partial(f.multi_step, loop_steps=ec.num_scheduler_steps),
            [params, cache, host, sampling, prev, counts],
            (rep, runner.cache_sharding, rep),
            multi_decodes,
        ),
        # The penalty counts of requests that just got a slot, from their histories.
        ProgramSpec(
            "penalty_reset",
            f.reset_penalty_rows,
            [counts, host, prev],
            rep,
            lambda: [((), runner.reset_args(inputs.penalty_reset([])))],
        ),
    ]
    if runner.lora_slots is not None:
        # LoRA: an adapter written into a device slot (one shape for every adapter and slot).
        lora = runner.lora_slots
        specs.append(
            ProgramSpec(
                "lora_write",
                write_slot,
                [Arg("lora", lora.shardings), Arg("slot", rep), Arg("adapter", lora.adapter_shardings)],
                lora.shardings,
                lambda: [((), runner.lora_write_args(0, None))],
            )
        )
    return {spec.name: spec for spec in specs}
