"""Per-step prefill and decode speed of the default model (jaxserve runner, default attention backend).

Times single compiled steps (the model and its greedy sampling, no scheduler), so it pairs with
`bench/peers/hf_steps.py`, which times the same shapes in Hugging Face transformers:

    python3 -m bench.steps [--unroll-layers] [--dtype float32|bfloat16] [--decode-batch 32 64]
    /path/to/python-with-torch bench/peers/hf_steps.py ~/.cache/jaxserve/smollm2-135m-instruct/*.gguf

Batch 1: one 128-token prompt, then 1-token decode steps at a 256-token context.
Batch 32: 32 prompts of 128 tokens (8 ragged steps of 4 x 128), then decode steps of each
`--decode-batch`. (The cpu layer matmul against XLA's dots: `python3 -m bench.matmul_cpu`.)
The steps attend over real histories (distinct blocks per sequence): the serving attention
backends stop at each sequence's length, so a step of empty sequences would time no attention.
"""
import argparse
import time

import jax
import numpy as np

from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.dtype_choice import load_dtype, resolve_dtype
from jaxserve.request import Request
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.output import ScheduledChunk


def chunks(r: ModelRunner, count: int, history: int, new: int, block_size: int) -> list[ScheduledChunk]:
    """`count` sequences computing `new` tokens after `history` cached ones, each on its own
    blocks, joined to the runner's batch (what prepare() does for the requests a step samples)."""
    pages = -(-(history + new) // block_size)
    r.inputs.batch.release_finished()  # the last call's requests (never run by a scheduler)
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
    parser.add_argument("--dtype", default="auto", help="the weights' (EngineConfig.dtype; auto: this machine's choice)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[32], help="decode batches past batch 1")
    args = parser.parse_args()
    config = resolve_dtype(EngineConfig(num_blocks=2048, unroll_layers=args.unroll_layers, dtype=args.dtype,
                                        decode_batch_buckets=(1, *args.decode_batch),
                                        max_num_seqs=max(32, *args.decode_batch)))
    m = load_model("smollm2-135m-instruct", dtype=load_dtype(config))
    r = ModelRunner(m.config, m.params, config)
    config = r.engine_config
    width, bs = config.block_table_buckets[-1], config.block_size
    p1 = timed(r, r.inputs.prefill(chunks(r, 1, 0, 128, bs), 128, config.max_prefill_seqs, width))
    p32 = timed(r, r.inputs.prefill(chunks(r, 4, 0, 128, bs), 512, config.max_prefill_seqs, width)) * 8
    print(f"{config.dtype} weights, {r.attention_backend} attention")
    print(f"prefill: batch 1 {128 / p1:.0f} tok/s ({p1 * 1e3:.0f} ms for 128), "
          f"batch 32 {32 * 128 / p32:.0f} tok/s ({p32 * 1e3:.0f} ms for 32 x 128)")
    for batch in (1, *args.decode_batch):
        d = timed(r, r.inputs.decode(chunks(r, batch, 255, 1, bs), batch, width))
        print(f"decode batch {batch}: {batch / d:.1f} tok/s ({d * 1e3:.1f} ms/step)")

if __name__ == "__main__":
    main()
