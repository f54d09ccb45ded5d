"""Stage `lora`: LoRA's cost in a decode step on the device (bench/lora_steps.py's measurement).

On the small model's shape, random weights in the plan's engine dtype: a decode step of the plan's
LoRA batch (64 rows on the GPU) spread over 8 adapters against the same rows of the base model on a
runner without LoRA (the issue's goal: at most 1.3x), and base rows on the LoRA runner. A problem
is recorded when a step's logits are not finite or the adapters' rows equal the base rows'.
"""

from __future__ import annotations

import numpy as np

from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord
from bench.lora_steps import step_times
from checkpoints.tiny_random import random_params

GOAL = 1.3
ADAPTERS = 8


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    config = plan.models[stage.model]
    params = random_params(config, dtype=plan.engine_dtype)
    batch = plan.workload.batches[-1] if plan.dry_run else 64
    rows, lora, _ = step_times(
        config,
        params,
        batch,
        [ADAPTERS],
        max_loras=ADAPTERS,
        rank=16,
        rounds=2 if plan.dry_run else 5,
        dtype=plan.engine_dtype,
    )
    base = rows[0][1]
    record.info(model=stage.model, batch=batch, adapters=ADAPTERS, rank=16, dtype=plan.engine_dtype)
    for label, seconds in rows:
        record.row({"case": label, "ms": seconds * 1e3, "vs_base": seconds / base})
    ratio = rows[-1][1] / base
    record.info(ratio_8_adapters=ratio, goal=GOAL, goal_met=ratio <= GOAL)
    logits = np.asarray(lora.step_logits(_program(lora, batch, ADAPTERS), warming_up=True))
    base_logits = np.asarray(lora.step_logits(_program(lora, batch, 0), warming_up=True))
    if not np.isfinite(logits).all():
        record.problem("LoRA rows' logits are not finite")
    if np.allclose(logits, base_logits):
        record.problem("LoRA rows' logits equal the base rows': the adapters were not applied")


def _program(runner, batch: int, num_adapters: int):
    from bench.steps import chunks

    rows = chunks(runner, batch, 256, 1, 16)
    for i, chunk in enumerate(rows):
        chunk.request.lora_slot = i % num_adapters if num_adapters else -1
    program = runner.inputs.decode(rows, batch, -(-257 // 16))
    runner.inputs.batch.release_finished()
    return program
