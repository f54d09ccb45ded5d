"""Runs a stage in its own process under a time limit and turns whatever happened into a result.

A process per stage keeps a GPU hang, an out-of-memory kill or a crash inside XLA from taking the
other stages down, and gives every stage a fresh device. The supervisor itself never imports JAX,
so it holds no device memory. A stage that overruns is stopped (SIGTERM, then SIGKILL for its
whole process group) and recorded as timed out, with the rows it had written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_check.plan import Stage

REPO = Path(__file__).resolve().parents[2]
COMMAND_BUFFER_FLAG = "--legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton"
UNKNOWN_FLAG = "Unknown flag in XLA_FLAGS"


def stage_environment(dry_run: bool, command_buffers: bool, compilation_cache: Path) -> dict[str, str]:
    """The stage's environment: this repository first on PYTHONPATH; the dry run on the CPU with
    the kernels interpreted; on the GPU, native kernels (unless JAXSERVE_PALLAS_INTERPRET says
    otherwise), 90% of device memory for JAX, and Triton calls inside CUDA command buffers when
    `command_buffers` (JAX_PLATFORMS is left as it is there).

    Every stage of a run shares JAX's persistent compilation cache in `compilation_cache`, so a
    stage that compiles what an earlier one did (the small model's engine again with overlap off)
    loads it instead of spending the run's time on it again; the first engine stage of each model
    still compiles cold, and its warm-up time is the one reported."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(compilation_cache))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAXSERVE_PALLAS_INTERPRET"] = "1"
    else:
        env.setdefault("JAXSERVE_PALLAS_INTERPRET", "0")
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] != COMMAND_BUFFER_FLAG.split("=")[0]]
    if command_buffers:
        flags.append(COMMAND_BUFFER_FLAG)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL if it is still there 5 s later."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_tail(path: Path, lines: int = 2) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in text[-lines:])[-300:]


def run_stage(stage: Stage, out_dir: Path, dry_run: bool, limit_s: float, command_buffers: bool) -> dict[str, Any]:
    json_path = out_dir / "stages" / f"{stage.name}.json"
    log_path = out_dir / "logs" / f"{stage.name}.log"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu_check.stage", stage.name, "--json", str(json_path)]
    if dry_run:
        cmd.append("--dry-run")
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=stage_environment(dry_run, command_buffers, out_dir / "xla_cache"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
    seconds = time.monotonic() - t0
    try:
        record = json.loads(json_path.read_text()) if json_path.exists() else {}
    except ValueError as e:  # cannot happen with write_json's rename, but never lose the run to it
        record = {"error": f"unreadable stage record: {e}"}
    error = record.get("error")
    problems = record.get("problems", [])
    if timed_out:
        status, error = "timeout", f"stopped after its {limit_s:.0f} s limit" + (f" ({error})" if error else "")
    elif proc.returncode != 0 or error or problems:
        status = "failed"
        if not error and not problems:
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            error = f"{how}: {_log_tail(log_path)}"
    else:
        status = "ok"
    return {
        "name": stage.name,
        "kind": stage.kind,
        "model": stage.model,
        "overlap": stage.overlap,
        "scheduler_steps": stage.scheduler_steps,
        "unroll_layers": stage.unroll_layers,
        "command_buffers": command_buffers,
        "status": status,
        "seconds": seconds,
        "limit_s": limit_s,
        "error": error,
        "problems": problems,
        "info": record.get("info", {}),
        "rows": record.get("rows", []),
        "log": str(log_path),
    }


def skipped(stage: Stage, reason: str, command_buffers: bool) -> dict[str, Any]:
    return {
        "name": stage.name,
        "kind": stage.kind,
        "model": stage.model,
        "overlap": stage.overlap,
        "scheduler_steps": stage.scheduler_steps,
        "unroll_layers": stage.unroll_layers,
        "command_buffers": command_buffers,
        "status": "skipped",
        "seconds": 0.0,
        "limit_s": 0.0,
        "error": reason,
        "problems": [],
        "info": {},
        "rows": [],
        "log": None,
    }


def rejected_flag(result: dict[str, Any]) -> bool:
    """Whether a stage died because this XLA does not know the command-buffer flag."""
    log = result.get("log")
    return result["status"] == "failed" and bool(log) and UNKNOWN_FLAG in Path(log).read_text(errors="replace")
