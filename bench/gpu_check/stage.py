"""One stage of the GPU check, in its own process (started by `python3 -m bench.gpu_check`):

    python3 -m bench.gpu_check.stage NAME --json PATH [--dry-run]

Writes the stage's record (bench/gpu_check/record.py) to PATH as it goes; an exception is
recorded as the stage's error. Exit status: 0 when the stage found no problem, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

from bench.gpu_check.plan import make_plan
from bench.gpu_check.record import StageRecord, describe_error

# stage kind -> (module, function): imported only in the stage's own process.
RUNNERS = {
    "env": ("bench.gpu_check.env_stage", "run"),
    "correctness": ("bench.gpu_check.correctness", "run"),
    "decode_kernels": ("bench.gpu_check.kernel_stages", "run_decode"),
    "prefill_kernels": ("bench.gpu_check.kernel_stages", "run_prefill"),
    "engine": ("bench.gpu_check.engine_stage", "run"),
    "models": ("bench.gpu_check.model_stage", "run"),
    "quantized_matmul": ("bench.gpu_check.quant_stage", "run"),
    "lora": ("bench.gpu_check.lora_stage", "run"),
    "mla_decode_kernel": ("bench.gpu_check.mla_stage", "run"),
    "hybrid": ("bench.gpu_check.hybrid_stage", "run"),
    "speculative": ("bench.gpu_check.spec_stage", "run"),
    "vision_encoder": ("bench.gpu_check.vision_stage", "run"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one stage of bench.gpu_check")
    parser.add_argument("name")
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    plan = make_plan(args.dry_run, command_buffer_variant=True)
    stage = plan.stage(args.name)
    record = StageRecord(args.json, stage.name)
    try:
        module, function = RUNNERS[stage.kind]
        getattr(importlib.import_module(module), function)(plan, stage, record)
    except Exception as e:
        traceback.print_exc()
        record.error(describe_error(e))
        return 1
    return 1 if record.data["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
