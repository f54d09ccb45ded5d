"""Stage `engine_<model>`: the real engine (`LLMEngine`, pallas attention) on a model of the plan's
shape with random weights made on the device, driven by token-id prompts.

Per batch size B, B random prompts go in at once; the engine steps until every sequence has its
first token (all prefills done), and the steps in which all B sequences decode (up to the one in
which the first finishes) are timed. Per batch this reports:

- tok/s and step ms: tokens and wall time of `engine.step()` over that window (scheduling, input
  arrays, the device step, sampling, the copy back, detokenization: everything but our loop);
- device ms: the same compiled decode step and sampler replayed back to back on device-resident
  inputs at the window's mean context, so the host never stalls the device: its busy time per step;
- roofline ms: (weight bytes + K/V bytes one step reads) / the copy bandwidth measured here;
- host %: 1 - device ms / step ms, the share of each step the device sits idle waiting for the host.

And for the stage: warm-up seconds, compilations after warm-up by the runner's count (must be 0)
and XLA backend compilations while serving (must be 0 too).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import kernel_bench
from bench.gpu_check.plan import OVERLAP_FIELD, EngineWorkload, Plan, Stage
from bench.gpu_check.random_model import random_model, weight_bytes_per_decode_step
from bench.gpu_check.record import StageRecord, describe_error
from checkpoints.config import ModelConfig
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.model import AttentionMetadata, KVCache
from jaxserve.runner import ModelRunner, checkpoint_shardings
from jaxserve.sampling_params import SamplingParams
from sharding.rules import replicated

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's name
KV_HEADROOM = 1.05  # blocks beyond the largest batch's need: the 1% watermark and block 0


def engine_config(plan: Plan, config: ModelConfig, stage: Stage) -> EngineConfig:
    """Buckets that cover the workload exactly (decode at each batch size, one prefill shape, one
    block-table width), so warm-up compiles only what serving uses, and a KV pool that fits it."""
    w = plan.workload
    pages = w.max_model_len // w.block_size
    num_blocks = int(max(w.batches) * pages * KV_HEADROOM) + 2
    overlap = {OVERLAP_FIELD: stage.overlap}
    return EngineConfig(
        block_size=w.block_size,
        kv_cache_memory=num_blocks * KVCache.bytes_per_block(config, w.block_size, plan.engine_dtype),
        max_num_seqs=max(w.batches),
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        max_prefill_seqs=w.max_prefill_seqs,
        dtype=plan.engine_dtype,
        attention_backend="pallas",
        decode_batch_buckets=w.batches,
        prefill_token_buckets=(w.max_num_batched_tokens,),
        prefill_seq_buckets=(w.max_prefill_seqs,),
        block_table_buckets=(pages,),
        num_scheduler_steps=stage.scheduler_steps,
        unroll_layers=stage.unroll_layers,
        **overlap,
    )


class CompileCounter:
    """XLA backend compilations seen (by jax.monitoring) while `counting` is on."""

    def __init__(self) -> None:
        self.count = 0
        self.counting = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: object) -> None:
        if self.counting and event == BACKEND_COMPILE_EVENT:
            self.count += 1


def decode_window(engine: LLMEngine, batch: int, w: EngineWorkload, rng: np.random.Generator) -> dict:
    """Add `batch` prompts, run them to the end, and time the all-decode window (see the module doc)."""
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(rng.integers(0, vocab, (batch, w.prompt_len))):
        engine.add_request(f"b{batch}-{i}", prompt.tolist(), params)
    generated: dict[str, int] = {}
    steps = tokens = kv_tokens = prefill_tokens = 0
    seconds = runner_seconds = 0.0
    finished = False
    stats = engine.stats
    while engine.has_unfinished_requests():
        timed = len(generated) == batch and not finished
        if timed:
            kv_tokens += sum(w.prompt_len + n for n in generated.values())  # each reads its whole sequence
        runner_before, prefill_before = stats.model_time, stats.prompt_tokens_computed
        t0 = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - t0
        for d in deltas:
            generated[d.request_id] = generated.get(d.request_id, 0) + len(d.token_ids)
            finished |= d.finished
        if timed:
            steps += 1
            seconds += elapsed
            runner_seconds += stats.model_time - runner_before
            prefill_tokens += stats.prompt_tokens_computed - prefill_before
            tokens += sum(len(d.token_ids) for d in deltas)
    if steps == 0:
        raise RuntimeError(f"batch {batch}: no step had all {batch} sequences decoding; raise max_tokens")
    # Per decode step (a token for every sequence): an engine step of multi-step decode is several.
    decode_steps = tokens / batch
    return {
        "batch": batch,
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "step_s": seconds / decode_steps,
        # the runner's host share: building and launching the iteration, then waiting to read it
        "runner_s": runner_seconds / decode_steps,
        "mean_context": kv_tokens / (steps * batch),
        "kv_tokens_per_step": kv_tokens / steps,
        "prefill_tokens_in_window": prefill_tokens,
    }


def device_step_seconds(runner: ModelRunner, batch: int, context: int, iters: int) -> float:
    """Device time of one decode step (model + sampler) of `batch` sequences of `context` tokens:
    the warm-up's executables replayed back to back on inputs already on the device. The pages
    read are blocks 1..batch*width, and the new K/V goes to block 0 (reserved, as padding's does),
    so nothing the engine holds is written."""
    width = runner.engine_config.block_table_buckets[-1]
    program = runner.inputs.decode([], batch, width)
    step = runner.executables.compiled[program.key]
    tables = (1 + np.arange(batch * width, dtype=np.int32)).reshape(batch, width)
    meta = AttentionMetadata(np.zeros(batch, np.int32), tables, np.full(batch, context, np.int32))
    tokens, _, _, logits_indices, token_src = program.host_args
    program = program._replace(
        host_args=(tokens, np.full(batch, context - 1, np.int32), meta, logits_indices, token_src)
    )
    # (state, host inputs, sampling, offset, sample_here)
    args = runner.step_args(program)
    inputs, here = jax.device_put(args[1:4], replicated(runner.mesh)), args[4]

    def once(state):
        updated, out = step(state.params, state.updatable(), *inputs, here)
        return out.sampled, state.join(updated)

    out, runner.state = once(runner.state)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(iters):
        out, runner.state = once(runner.state)
    jax.block_until_ready((out, runner.state))
    return (time.perf_counter() - t0) / iters


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    config = plan.models[stage.model]
    w = plan.workload
    copy_bps = kernel_bench.copy_bandwidth(plan.copy_bytes, jnp.dtype(plan.engine_dtype), plan.iters)
    ec = engine_config(plan, config, stage)
    t0 = time.perf_counter()
    engine = LLMEngine(random_model(config, plan.engine_dtype, checkpoint_shardings(ec)(config)), ec)
    init_s = time.perf_counter() - t0
    runner = engine.runner
    weight_bytes = weight_bytes_per_decode_step(runner.params, runner.config)
    kv_bytes_per_token = KVCache.bytes_per_block(runner.config, w.block_size, plan.engine_dtype) // w.block_size
    warm_up_s = engine.warm_up()
    compiled = runner.num_compilations
    record.info(
        model=stage.model,
        config=config.to_dict(),
        dtype=plan.engine_dtype,
        attention_backend="pallas",
        overlap=stage.overlap,
        scheduler_steps=stage.scheduler_steps,
        unroll_layers=stage.unroll_layers,
        copy_bps=copy_bps,
        init_s=init_s,
        warm_up_s=warm_up_s,
        compilations_at_warm_up=compiled,
        weight_bytes=weight_bytes,
        num_blocks=runner.num_blocks,
        kv_bytes_per_token=kv_bytes_per_token,
        buckets=runner.bucket_summary(),
        workload={"prompt_len": w.prompt_len, "max_tokens": w.max_tokens},
    )
    counter = CompileCounter()
    rng = np.random.default_rng(0)
    for batch in w.batches:
        counter.counting = True
        row = decode_window(engine, batch, w, rng)
        counter.counting = False
        row["roofline_s"] = (weight_bytes + row["kv_tokens_per_step"] * kv_bytes_per_token) / copy_bps
        row["pct_roofline"] = 100 * row["roofline_s"] / row["step_s"]
        row["overlap"] = stage.overlap
        try:
            row["device_s"] = device_step_seconds(runner, batch, round(row["mean_context"]), plan.iters)
            row["pct_roofline_device"] = 100 * row["roofline_s"] / row["device_s"]
            row["host_pct"] = 100 * max(0.0, 1 - row["device_s"] / row["step_s"])
        except Exception as e:  # the serving figures stand without the replay
            row.update(device_s=None, pct_roofline_device=None, host_pct=None)
            record.problem(f"batch {batch}: replaying the decode step failed: {describe_error(e)}")
        record.row(row)
        if row["prefill_tokens_in_window"]:
            record.problem(f"batch {batch}: prefill ran inside the timed decode window")
    after = runner.num_compilations - compiled
    record.info(compilations_after_warm_up=after, xla_compilations_serving=counter.count)
    if after or counter.count:
        record.problem(f"compiled after warm-up: {after} runner programs, {counter.count} XLA programs while serving")
    usage = engine.kv.usage()
    record.info(kv_blocks_used_at_end=usage.used)
    if engine.has_unfinished_requests() or usage.used:
        record.problem(f"requests or KV blocks left in the engine ({usage.used} blocks used)")
