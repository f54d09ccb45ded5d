"""Per-step prefill and decode speed of the default model (jaxserve runner, default attention backend).

Times single compiled steps (the model and its greedy sampling, no scheduler), so it pairs with
`bench/peers/hf_steps.py`, which times the same shapes in Hugging Face transformers:

    python3 -m bench.steps [--unroll-layers]
    /path/to/python-with-torch bench/peers/hf_steps.py ~/.cache/jaxserve/smollm2-135m-instruct/*.gguf

Batch 1: one 128-token prompt, then 1-token decode steps at a 256-token context.
Batch 32: 32 prompts of 128 tokens (8 ragged steps of 4 x 128), then batch-32 decode steps.
On CPU it also times the same steps with XLA's dots in place of the cpu layer matmul
(`kernels_pallas/cpu_matmul.py`), in the same run.
The steps attend over real histories (distinct blocks per sequence): the serving attention
backends stop at each sequence's length, so a step of empty sequences would time no attention.
"""
import argparse
import time

import jax
import numpy as np

from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.request import Request
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.output import ScheduledChunk


def chunks(r: ModelRunner, count: int, history: int, new: int, block_size: int) -> list[ScheduledChunk]:
    """`count` sequences computing `new` tokens after `history` cached ones, each on its own
    blocks, joined to the runner's batch (what prepare() does for the requests a step samples)."""
    pages = -(-(history + new) // block_size)
    out = []
    for i in range(count):
        req = Request(f"r{i}", list(range(1, history + new + 1)), SamplingParams(max_tokens=1), seed=i)
        r.inputs.batch.join(req)
        out.append(ScheduledChunk(req, history, new, np.arange(1 + i * pages, 1 + (i + 1) * pages, dtype=np.int32),
                                  sample=True))
    return out


def timed(r: ModelRunner, program, reps: int = 3) -> float:
    """Best wall time of one compiled step over `reps` runs."""
    best = float("inf")
    for _ in range(reps + 1):  # the first run compiles and warms up
        t = time.perf_counter()
        r.step_logits(program, warming_up=True).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unroll-layers", action="store_true", help="the layers unrolled (EngineConfig.unroll_layers)")
    args = parser.parse_args()
    m = load_model("smollm2-135m-instruct")
    config = EngineConfig(num_blocks=1024, unroll_layers=args.unroll_layers)
    runners = {"jaxserve": ModelRunner(m.config, m.params, config)}
    if runners["jaxserve"].model.cpu_matmul is not None:  # its peer in this run: XLA's dots
        plain = ModelRunner(m.config, m.params, config)
        plain.model = plain.model.clone(cpu_matmul=None)
        plain.params = jax.device_put(m.params)  # the [K, N] layout, not the kernel's panels
        runners["jaxserve, XLA dots"] = plain
    times = {name: step_times(r, r.engine_config) for name, r in runners.items()}
    for name, (p1, p32, d1, d32) in times.items():
        print(f"{name} batch 1: prefill {128/p1:.0f} tok/s ({p1*1e3:.0f} ms), decode {1/d1:.1f} tok/s ({d1*1e3:.1f} ms/step)")
        print(f"{name} batch 32: prefill {32*128/p32:.0f} tok/s ({p32*1e3:.0f} ms for 32x128), "
              f"decode {32/d32:.1f} tok/s ({d32*1e3:.1f} ms/step)")
    if len(times) == 2:
        ours, xla = times.values()
        print("cpu layer matmul vs XLA dots (time ratio): prefill b1 {:.2f}x, prefill b32 {:.2f}x, decode b1 {:.2f}x, "
              "decode b32 {:.2f}x".format(*(x / o for o, x in zip(ours, xla))))


def step_times(r: ModelRunner, config: EngineConfig) -> tuple[float, float, float, float]:
    """Best times of: a 128-token prefill, 32 x 128 tokens of prefill (8 steps of 4 x 128), and
    decode steps at a 256-token context at batch 1 and 32."""
    width, bs = config.block_table_buckets[-1], config.block_size
    p1 = timed(r, r.inputs.prefill(chunks(r, 1, 0, 128, bs), 128, config.max_prefill_seqs, width))
    p32 = timed(r, r.inputs.prefill(chunks(r, 4, 0, 128, bs), 512, config.max_prefill_seqs, width)) * 8
    d1 = timed(r, r.inputs.decode(chunks(r, 1, 255, 1, bs), 1, width))
    d32 = timed(r, r.inputs.decode(chunks(r, 32, 255, 1, bs), 32, width))
    return p1, p32, d1, d32

if __name__ == "__main__":
    main()
