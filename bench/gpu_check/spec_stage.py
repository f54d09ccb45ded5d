"""Stage `speculative`: MTP speculative decoding (DeepSeek-V3's multi-token prediction layer drafting
`DRAFT_TOKENS` tokens per step) on a DeepSeek-V3-shaped model with random weights made on the device,
against the same model and engine settings without it.

A random MTP layer's drafts are almost never accepted, so the stage measures what speculation costs,
not what it gains: per batch size, each engine's output tokens/s in the window where every sequence
decodes (`engine_stage.decode_window`) and their ratio, and the cost model's terms per verify step:
D, the time spent drafting, and V, the rest of the step (the verify pass over k + 1 positions), both
over T, a plain decode step. With a mean of a accepted drafts a step gives (1 + a) tokens, so
speculation pays when (1 + a) T > D + V; the rows say which a a real draft head must reach here
(`break_even_accepted`). Greedy outputs must be identical (verification keeps the target's tokens),
and neither engine may compile after warm-up.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from bench import spec_report
from bench.gpu_check.engine_stage import CompileCounter, decode_window
from bench.gpu_check.plan import EngineWorkload, Plan, Stage
from bench.gpu_check.random_model import random_model
from bench.gpu_check.record import StageRecord
from checkpoints.config import ModelConfig
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.runner import checkpoint_shardings
from jaxserve.sampling_params import SamplingParams
from jaxserve.speculative.config import SpeculativeConfig

DRAFT_TOKENS = 3


def workload(plan: Plan) -> EngineWorkload:
    """The engine stages' workload at its two smallest batch sizes (where drafting can pay; and two
    engines' warm-ups fit the stage's limit)."""
    return dataclasses.replace(plan.workload, batches=plan.workload.batches[:2])


def engine_config(plan: Plan, config: ModelConfig, speculative: bool) -> EngineConfig:
    """The workload's shapes (as the engine stages'), with a KV pool counted in blocks (MLA's latent
    blocks), and with MTP drafting at every batch size of the workload when `speculative`."""
    w = workload(plan)
    pages = w.max_model_len // w.block_size
    spec = None
    if speculative:
        spec = SpeculativeConfig(
            method="mtp", num_speculative_tokens=DRAFT_TOKENS, disable_by_batch_size=max(w.batches)
        )
    return EngineConfig(
        block_size=w.block_size,
        num_blocks=max(w.batches) * (pages + 1) + 2,
        max_num_seqs=max(w.batches),
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        max_prefill_seqs=w.max_prefill_seqs,
        dtype=plan.engine_dtype,
        decode_batch_buckets=w.batches,
        prefill_token_buckets=(w.max_num_batched_tokens,),
        prefill_seq_buckets=(w.max_prefill_seqs,),
        block_table_buckets=(pages,),
        speculative_config=spec,
    )


def _engine(plan: Plan, config: ModelConfig, speculative: bool) -> tuple[LLMEngine, float]:
    """An engine on the random model (the same seed: the same weights for both) and its warm-up seconds."""
    ec = engine_config(plan, config, speculative)
    engine = LLMEngine(random_model(config, plan.engine_dtype, checkpoint_shardings(ec)(config)), ec)
    return engine, engine.warm_up()


def _outputs(engine: LLMEngine, prompts: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt, all at once."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"check-{i}", prompt.tolist(), params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    return [out[f"check-{i}"] for i in range(len(prompts))]


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    config = plan.models[stage.model]
    w = workload(plan)
    plain, plain_warm_s = _engine(plan, config, speculative=False)
    spec, spec_warm_s = _engine(plan, config, speculative=True)
    compiled = {"plain": plain.runner.num_compilations, "spec": spec.runner.num_compilations}
    record.info(
        model=stage.model,
        config=config.to_dict(),
        dtype=plan.engine_dtype,
        draft_tokens=DRAFT_TOKENS,
        warm_up_s={"plain": plain_warm_s, "spec": spec_warm_s},
        workload={"prompt_len": w.prompt_len, "max_tokens": w.max_tokens},
    )
    counter = CompileCounter()
    for batch in w.batches:
        counter.counting = True
        before = spec.snapshot()
        base = decode_window(plain, batch, w, np.random.default_rng(batch))
        row = decode_window(spec, batch, w, np.random.default_rng(batch))
        counts = spec_report.from_snapshots(before, spec.snapshot())
        counter.counting = False
        row.update(_cost_terms(base, row, counts))
        record.row(row)
        if counts is None:
            record.problem(f"batch {batch}: the speculative engine drafted nothing")
    prompts = np.random.default_rng(7).integers(0, config.vocab_size, (max(w.batches), w.prompt_len))
    t0 = time.perf_counter()
    same = _outputs(plain, prompts, w.max_tokens) == _outputs(spec, prompts, w.max_tokens)
    record.info(greedy_outputs_identical=same, greedy_check_s=time.perf_counter() - t0)
    if not same:
        record.problem("greedy outputs differ with and without MTP drafts")
    after = {name: e.runner.num_compilations - compiled[name] for name, e in (("plain", plain), ("spec", spec))}
    record.info(compilations_after_warm_up=after, xla_compilations_serving=counter.count)
    if any(after.values()) or counter.count:
        record.problem(f"compiled after warm-up: {after} runner programs, {counter.count} XLA programs while serving")
    for name, engine in (("plain", plain), ("spec", spec)):
        used = engine.kv.usage().used
        if engine.has_unfinished_requests() or used:
            record.problem(f"{name}: requests or KV blocks left in the engine ({used} blocks used)")


def _cost_terms(base: dict, row: dict, counts: dict | None) -> dict:
    """The row's cost model against the plain engine's row of the same batch (module doc)."""
    plain_step = base["step_s"]
    out = {
        "plain_tok_per_s": base["tok_per_s"],
        "ratio": row["tok_per_s"] / base["tok_per_s"],
        "plain_step_s": plain_step,
    }
    if not counts:
        return out
    step = row["seconds"] / row["steps"]  # one engine step of the speculative engine: draft + verify
    draft = counts["draft_seconds"] / max(counts["verify_steps"], 1)
    out.update(
        acceptance_rate=counts["acceptance_rate"],
        mean_accepted_tokens=counts["mean_accepted_tokens"],
        draft_over_plain=draft / plain_step,
        verify_over_plain=(step - draft) / plain_step,
        break_even_accepted=step / plain_step - 1,
    )
    return out
