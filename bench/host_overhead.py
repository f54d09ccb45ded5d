"""Host time per engine step, with the tiny random model (its device work is ~0, so what the
step costs is the host's: scheduling, building arrays, launching, reading, post-processing).

    python3 -m bench.host_overhead [--batch 64 256] [--steps 200]

For each batch size, B requests decode together (short prompts, `ignore_eos`, enough
`max_tokens` to stay decoding), with async scheduling on and off, in the same run. Reported per
step: wall time of `LLMEngine.step()`, the part spent blocked reading the device's output, and
a profile of where the host time goes (cProfile, grouped by the engine's phases).
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

# Functions whose cumulative time is one phase of a step (cProfile names: file:line(function)).
PHASES = {
    "schedule": "scheduler.py", "prepare": "prepare", "launch": "launch", "read": "fetch",
    "post-process": "_process",
}


def build_engine(batch: int, async_scheduling: bool) -> LLMEngine:
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * 8), max_model_len=1024,
                          num_blocks=batch * 40, decode_batch_buckets=(batch,),
                          prefill_seq_buckets=(4,), async_scheduling=async_scheduling)
    engine = LLMEngine(build_tiny_random(), config)
    engine.warm_up()
    return engine


def measure(batch: int, steps: int, async_scheduling: bool) -> dict:
    engine = build_engine(batch, async_scheduling)
    params = SamplingParams(max_tokens=2 * steps + 50, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + i % 200, 5, 7, 11], params)
    while any(r.is_prefilling or not r.output_token_ids for r in list(engine.scheduler.waiting) + engine.scheduler.running):
        engine.step()  # prefill everything first: what follows is decode only
    for _ in range(5):
        engine.step()
    compiles = engine.num_compilations
    reads = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
        reads += engine.runner.last_fetch_time
    wall = (time.perf_counter() - t0) / steps
    profile = cProfile.Profile()  # a second pass, profiled: where the host time goes
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    for rid in list(engine._groups):
        engine.abort(rid)
    stats = pstats.Stats(profile)
    phases = {}
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():
        for phase, needle in PHASES.items():
            if needle == function or (needle.endswith(".py") and filename.endswith(needle) and function == "schedule"):
                phases[phase] = phases.get(phase, 0.0) + cumulative / steps
    return {"batch": batch, "async": async_scheduling, "step_ms": 1e3 * wall, "read_ms": 1e3 * reads / steps,
            "phases_ms": {k: 1e3 * v for k, v in phases.items()},
            "new_compilations": engine.num_compilations - compiles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"{'batch':>5} {'async':>5} {'step ms':>8} {'read ms':>8} {'host ms':>8}  profile (ms per step, cProfile-inflated)")
    for batch in args.batch:
        for flag in (False, True):
            r = measure(batch, args.steps, flag)
            phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["phases_ms"].items()))
            print(f"{batch:>5} {str(flag):>5} {r['step_ms']:8.2f} {r['read_ms']:8.2f} "
                  f"{r['step_ms'] - r['read_ms']:8.2f}  {phases}; compilations after warm-up {r['new_compilations']}")


if __name__ == "__main__":
    main()
