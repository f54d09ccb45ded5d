"""Per-step prefill and decode speed of the default model (jaxserve runner, reference attention).

Times single compiled steps (no scheduler, no sampling), so it pairs with
`bench/peers/hf_steps.py`, which times the same shapes in Hugging Face transformers:

    python3 -m bench.steps
    /path/to/python-with-torch bench/peers/hf_steps.py ~/.cache/jaxserve/smollm2-135m-instruct/*.gguf

Batch 1: one 128-token prompt, then 1-token decode steps at a 256-token context.
Batch 32: 32 prompts of 128 tokens (8 ragged steps of 4 x 128), then batch-32 decode steps.
"""
import time

from checkpoints.registry import load_model
from jaxserve.config import EngineConfig
from jaxserve.runner import ModelRunner


def timed(r: ModelRunner, program, reps: int = 3) -> float:
    """Best wall time of one compiled step over `reps` runs."""
    key, args = program.key, r.step_args(program)
    exe = r._compiled(key, r._step, args, True)
    a, best = list(args), float("inf")
    for _ in range(reps + 1):  # the first run is a warm-up
        a[1] = r.cache
        t = time.perf_counter()
        logits, r.cache, _ = exe(*a)
        logits.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    m = load_model("smollm2-135m-instruct")
    r = ModelRunner(m.config, m.params, EngineConfig(num_blocks=1024))
    # one 128-token prompt: one prefill step of 128 tokens; 32 prompts of 128: 8 steps of 4 x 128 = 512 tokens
    p1 = timed(r, r.inputs.prefill([], 128, 1, 8))
    p32 = timed(r, r.inputs.prefill([], 512, 4, 8)) * 8
    d1 = timed(r, r.inputs.decode([], 1, 16))
    d32 = timed(r, r.inputs.decode([], 32, 16))
    print(f"jaxserve batch 1: prefill {128/p1:.0f} tok/s ({p1*1e3:.0f} ms), decode {1/d1:.1f} tok/s ({d1*1e3:.1f} ms/step)")
    print(f"jaxserve batch 32: prefill {32*128/p32:.0f} tok/s ({p32*1e3:.0f} ms for 32x128), decode {32/d32:.1f} tok/s ({d32*1e3:.1f} ms/step)")


if __name__ == "__main__":
    main()
