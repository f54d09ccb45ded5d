"""Per-step prefill and decode speed of the default model (jaxserve runner, default attention backend).

Times single compiled steps (the model and its greedy sampling, no scheduler), so it pairs with
`bench/peers/hf_steps.py`, which times the same shapes in Hugging Face transformers:

    python3 -m bench.steps [--unroll-layers] [--dtype float32|bfloat16] [--kv-cache-dtype D]
                           [--quantization none|int8|q4|gguf] [--decode-batch 32 64] [--profile] [--cpu-time]
    /path/to/python-with-torch bench/peers/hf_steps.py ~/.cache/jaxserve/smollm2-135m-instruct/*.gguf

Prefill steps: one 128-token prompt; a ragged step of 4 x 128 prompts; a 512-token chunk over
512 cached tokens (a ~1,000-token prompt's second chunk). Decode steps at a 256-token context, at
batch 1 and each `--decode-batch`. `--profile`: per step, the compiled program's costliest operations
(jax.profiler's trace of XLA:CPU's thunks; custom calls named by their kernel). (The cpu layer
matmul against XLA's dots: `python3 -m bench.matmul_cpu`.)
The steps attend over real histories (distinct blocks per sequence): the serving attention
backends stop at each sequence's length, so a step of empty sequences would time no attention.
"""

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import numpy as np

from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.dtype_choice import load_dtype, weights_dtype
from jaxserve.request import Request
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.output import ScheduledChunk
from kernels_pallas import kv_quant


def chunks(r: ModelRunner, count: int, history: int, new: int, block_size: int) -> list[ScheduledChunk]:
    """`count` sequences computing `new` tokens after `history` cached ones, each on its own
    blocks, joined to the runner's batch (what prepare() does for the requests a step samples)."""
    pages = -(-(history + new) // block_size)
    r.inputs.batch.release_finished()  # the last call's requests (never run by a scheduler)
    out = []
    for i in range(count):
        req = Request(f"r{i}", list(range(1, history + new + 1)), SamplingParams(max_tokens=1), seed=i)
        r.inputs.batch.join(req)
        out.append(
            ScheduledChunk(
                req, history, new, np.arange(1 + i * pages, 1 + (i + 1) * pages, dtype=np.int32), sample=True
            )
        )
    return out


def timed(r: ModelRunner, program, reps: int = 3, clock=time.perf_counter) -> float:
    """Best time of one compiled step over `reps` runs: wall time, or with `clock=time.process_time`
    the process's CPU seconds (all its threads: the step's own work on a crowded machine)."""
    best = float("inf")
    for _ in range(reps + 1):  # the first run compiles and warms up
        t = clock()
        r.step_logits(program, warming_up=True).block_until_ready()
        best = min(best, clock() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unroll-layers", action="store_true", help="the layers unrolled (EngineConfig.unroll_layers)")
    parser.add_argument(
        "--dtype", default="auto", help="the weights' (EngineConfig.dtype; auto: this machine's choice)"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype")
    parser.add_argument("--quantization", default="none", help="EngineConfig.quantization (weight-only)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[32], help="decode batches past batch 1")
    parser.add_argument("--profile", action="store_true", help="each step's costliest operations")
    parser.add_argument("--cpu-time", action="store_true", help="the process's CPU seconds per step, not wall time")
    args = parser.parse_args()
    asked = EngineConfig(
        num_blocks=2048,
        unroll_layers=args.unroll_layers,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        decode_batch_buckets=(1, *args.decode_batch),
        max_num_seqs=max(32, *args.decode_batch),
    )
    dtype = weights_dtype(asked)
    gguf_blocks = asked.quantization == "gguf"
    m = load_model("smollm2-135m-instruct", dtype=load_dtype(asked.quantization, dtype), gguf_blocks=gguf_blocks)
    config = resolve(asked, m.config, dtype)
    r = ModelRunner(m.config, m.params, config)
    width, bs, seqs = config.block_table_buckets[-1], config.block_size, config.max_prefill_seqs
    print(
        f"{config.dtype} weights ({config.quantization} quantization), {kv_quant.format_name(r.kv_dtype)} KV cache, "
        f"{r.attention_backend} attention"
    )
    steps = [
        ("prefill 1 x 128", 128, lambda: r.inputs.prefill(chunks(r, 1, 0, 128, bs), 128, seqs, width)),
        ("prefill 4 x 128", 512, lambda: r.inputs.prefill(chunks(r, 4, 0, 128, bs), 512, seqs, width)),
        ("prefill 512 over 512", 512, lambda: r.inputs.prefill(chunks(r, 1, 512, 512, bs), 512, seqs, width)),
    ]
    steps += [
        (f"decode batch {b}", b, lambda b=b: r.inputs.decode(chunks(r, b, 255, 1, bs), b, width))
        for b in (1, *args.decode_batch)
    ]
    for name, tokens, build in steps:
        program = build()
        t = timed(r, program, clock=time.process_time if args.cpu_time else time.perf_counter)
        print(f"{name}: {tokens / t:.0f} tok/s ({t * 1e3:.1f} ms/step)")
        if args.profile:
            for ms, count, op in profile(r, program):
                print(f"    {ms:8.2f} ms  {count:3d}x  {op}")


def profile(r: ModelRunner, program, reps: int = 3, top: int = 10) -> list[tuple[float, int, str]]:
    """The `top` costliest operations of `program`'s compiled step: (ms per step, calls per
    step, name), from a jax.profiler trace of `reps` steps; custom calls named by their kernel."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(reps):
            r.step_logits(program, warming_up=True).block_until_ready()
        jax.profiler.stop_trace()
        events = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(("ThunkExecutor", "$", "PjitFunction")):
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    hlo = r._executables[program.key].as_text()  # the compiled step (ModelRunner._run's cache)
    kernels = dict(re.findall(r"%?(ffi_call\.\d+) = .*?custom_call_target=\"([^\"]+)\"", hlo))
    return [
        (us / reps / 1e3, calls[op] // reps, f"{op} {kernels.get(op, '')}".strip()) for op, us in total.most_common(top)
    ]


if __name__ == "__main__":
    main()
