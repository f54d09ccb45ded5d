"""Host time per engine step, with the tiny random model (its device work is ~0, so what the
step costs is the host's: scheduling, building arrays, launching, reading, post-processing).

    python3 -m bench.host_overhead [--batch 64 256] [--steps 200] [--num-scheduler-steps 8]

For each batch size, B requests decode together (short prompts, `ignore_eos`, enough
`max_tokens` to stay decoding), with async scheduling on and off, and with multi-step decode
(`--num-scheduler-steps` K decode steps per device loop, read at once) when K > 1, in the same
run. Reported per decode step (one token for every row; a multi-step iteration is K of them):
wall time of `LLMEngine.step()`, the part spent blocked reading the device's output, and a
profile of where the host time goes (cProfile, grouped by the engine's phases).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

# The function whose cumulative time is one phase of a step: (file, function) as cProfile names them.
PHASES = {
    "schedule": ("scheduler.py", "schedule"),
    "prepare": ("model_runner.py", "prepare"),
    "launch": ("model_runner.py", "run_model"),
    "sample": ("model_runner.py", "run_sampler"),
    "read": ("model_runner.py", "fetch"),
    "post-process": ("engine.py", "_read"),
}


def build_engine(batch: int, async_scheduling: bool, num_scheduler_steps: int) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=max(512, batch * 8),
        max_model_len=1024,
        num_blocks=batch * 40,
        decode_batch_buckets=(batch,),
        prefill_seq_buckets=(4,),
        async_scheduling=async_scheduling,
        num_scheduler_steps=num_scheduler_steps,
    )
    engine = LLMEngine(build_tiny_random(), config)
    engine.warm_up()
    return engine


def measure(batch: int, steps: int, async_scheduling: bool, num_scheduler_steps: int = 1) -> dict:
    """Per decode step (`steps` of them, timed twice: plain, then profiled)."""
    engine = build_engine(batch, async_scheduling, num_scheduler_steps)
    params = SamplingParams(max_tokens=2 * steps + 50, temperature=0.0, ignore_eos=True)
    iterations = max(1, steps // num_scheduler_steps)
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + i % 200, 5, 7, 11], params)
    while any(
        r.is_prefilling or not r.output_token_ids for r in list(engine.scheduler.waiting) + engine.scheduler.running
    ):
        engine.step()  # prefill everything first: what follows is decode only
    for _ in range(5):
        engine.step()
    compiles = engine.num_compilations
    reads = 0.0
    generated = engine.stats.generated_tokens
    t0 = time.perf_counter()
    for _ in range(iterations):
        engine.step()
        reads += engine.runner.last_fetch_time
    wall = time.perf_counter() - t0
    steps = (engine.stats.generated_tokens - generated) / batch  # decode steps taken
    wall /= steps
    profile = cProfile.Profile()  # a second pass, profiled: where the host time goes
    profile.enable()
    for _ in range(iterations):
        engine.step()
    profile.disable()
    for rid in list(engine._groups):
        engine.abort(rid)
    stats = pstats.Stats(profile)
    phases = {}
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():
        for phase, (file, name) in PHASES.items():
            if function == name and filename.endswith(file):
                phases[phase] = phases.get(phase, 0.0) + cumulative / steps
    return {
        "batch": batch,
        "mode": f"{num_scheduler_steps}-step" if num_scheduler_steps > 1 else "async" if async_scheduling else "sync",
        "step_ms": 1e3 * wall,
        "read_ms": 1e3 * reads / steps,
        "phases_ms": {k: 1e3 * v for k, v in phases.items()},
        "new_compilations": engine.num_compilations - compiles,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--num-scheduler-steps", type=int, default=8, help="K of the multi-step run (1: none)")
    args = ap.parse_args()
    modes = [(False, 1), (True, 1)] + ([(True, args.num_scheduler_steps)] if args.num_scheduler_steps > 1 else [])
    print(
        f"{'batch':>5} {'mode':>7} {'step ms':>8} {'read ms':>8} {'host ms':>8}  "
        "profile (ms per decode step, cProfile-inflated)"
    )
    for batch in args.batch:
        for async_scheduling, k in modes:
            r = measure(batch, args.steps, async_scheduling, k)
            phases = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(r["phases_ms"].items()))
            print(
                f"{batch:>5} {r['mode']:>7} {r['step_ms']:8.2f} {r['read_ms']:8.2f} "
                f"{r['step_ms'] - r['read_ms']:8.2f}  {phases}; compilations after warm-up {r['new_compilations']}"
            )


if __name__ == "__main__":
    main()
