"""GPU proof in one command: kernels and engine on one GPU, nothing to download or carry.

    python3 -m bench.gpu_check                # on the GPU machine; results in $OUT (or --out DIR)
    python3 -m bench.gpu_check --dry-run      # the same stages on CPU: tiny shapes, interpreted kernels

Stages (each in its own process, under its own time limit, all within the plan's budget):
env, correctness, decode_kernels (the Triton and Mosaic GPU decode kernels against JAX's
paged_attention and the copy bandwidth, ending with the pick of this GPU generation's default
decode kernel), prefill_kernels, one engine stage per model shape (SmolLM2-135M and Llama-3-8B,
random bf16 weights made on the device), and, on the GPU, the small model's engine again with
Triton command buffers off when time remains. A stage that fails or overruns is recorded as such
and the next one runs. Writes gpu_check.json (everything), gpu_check.txt (the table, also
printed), stages/*.json and logs/*.log. Exit status 0 when every stage passed.
See bench/README.md ("GPU check") for reading the table, docs/gpu.md for the kernels and the pick.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path

from bench.gpu_check.plan import Stage, make_plan
from bench.gpu_check.record import write_json
from bench.gpu_check.supervise import COMMAND_BUFFER_FLAG, rejected_flag, run_stage, skipped
from bench.gpu_check.table import render

MIN_STAGE_S = 15  # a stage is not started with less time than this left


def _out_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return Path("out") / "gpu_check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


@dataclasses.dataclass
class Run:
    """One run of the plan: where results go, the deadline, and what the env stage decided."""

    out: Path
    dry_run: bool
    deadline: float
    command_buffers: bool
    summary: dict
    env_ok: bool = True

    def stage(self, stage: Stage) -> dict:
        """Run `stage` (or skip it, saying why) and return its result."""
        left = self.deadline - time.monotonic()
        wanted = self.command_buffers and stage.command_buffers is not False
        if not self.env_ok:
            return skipped(stage, "the env stage failed", wanted)
        if left < MIN_STAGE_S or (stage.optional and left < stage.limit_s):
            return skipped(stage, f"time budget: {left:.0f} s left", wanted)
        if stage.command_buffers is False and not self.command_buffers:
            return skipped(stage, "command buffers are off for the whole run", False)
        result = run_stage(stage, self.out, self.dry_run, min(stage.limit_s, left), wanted)
        if wanted and stage.kind == "env" and result["status"] != "ok":
            # Unknown to this XLA, or breaking the kernel chain: run everything without the flag.
            why = "unknown to this XLA" if rejected_flag(result) else (result["error"] or result["problems"][0])
            self.command_buffers = False
            self.summary["command_buffers"] = f"off (the env stage failed with the flag: {why[:120]})"
            result = run_stage(
                stage, self.out, self.dry_run, min(stage.limit_s, self.deadline - time.monotonic()), False
            )
        if stage.kind == "env":
            self.env_ok = result["status"] == "ok"
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreted kernels")
    parser.add_argument("--out", default=None, help="results folder (default $OUT, else out/gpu_check/TIME)")
    parser.add_argument(
        "--triton-command-buffers",
        choices=("on", "off", "both"),
        default="both",
        help=f"pass {COMMAND_BUFFER_FLAG} to XLA (GPU only): on, off, or on plus one "
        "engine stage with it off when time remains (default)",
    )
    parser.add_argument(
        "--stages", nargs="+", default=None, metavar="NAME", help="run only these stages (env always runs)"
    )
    args = parser.parse_args(argv)
    plan = make_plan(args.dry_run, command_buffer_variant=args.triton_command_buffers == "both")
    unknown = set(args.stages or ()) - {s.name for s in plan.stages}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from: {', '.join(s.name for s in plan.stages)}")
    stages = [s for s in plan.stages if args.stages is None or s.name in args.stages or s.kind == "env"]

    out = _out_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command_buffers = not args.dry_run and args.triton_command_buffers != "off"
    start = time.monotonic()
    summary = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "budget_s": plan.budget_s,
        "command_buffer_flag": COMMAND_BUFFER_FLAG,
        "command_buffers": "n/a (CPU)" if args.dry_run else ("on" if command_buffers else "off"),
        "stages": [],
        "total_s": 0.0,
    }
    run = Run(out, args.dry_run, start + plan.budget_s, command_buffers, summary)
    print(
        f"gpu_check ({summary['mode']}): {len(stages)} stages, budget {plan.budget_s:.0f} s, results in {out}",
        flush=True,
    )
    for stage in stages:
        result = run.stage(stage)
        summary["stages"].append(result)
        summary["total_s"] = time.monotonic() - start
        write_json(out / "gpu_check.json", summary)
        note = f": {result['error'] or '; '.join(result['problems'][:1])}" if result["status"] != "ok" else ""
        print(f"  {stage.name:<32} {result['status']:<8} {result['seconds']:6.1f} s{note}", flush=True)
    table = render(summary, plan)
    (out / "gpu_check.txt").write_text(table)
    print("\n" + table, end="", flush=True)
    passed = all(
        s["status"] == "ok" or (s["status"] == "skipped" and plan.stage(s["name"]).optional) for s in summary["stages"]
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
