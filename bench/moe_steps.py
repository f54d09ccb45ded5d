"""Decode step time of a mixture-of-experts model with and without expert parallelism.

    python3 -m bench.moe_steps [--devices 4] [--layouts 1x1 2x1 4x1 2x2] [--batches 8 32] [--experts 8]

A random Mixtral-shaped model (`--experts` experts, top-2; 4 layers, hidden 512, experts of 1,024
hidden units: 50 M expert parameters) on `--devices` JAX devices; on a machine without
accelerators the CPU is split into that many (they share its cores, so expert parallelism shows
its communication and bookkeeping, not a speed-up). For each layout EPxTP it builds the runner on
the first ep x tp devices and times its compiled decode step (the model and its greedy sampling,
no scheduler) at each batch size, over histories of 256 tokens; it prints each layout's time
against one device's, measured in the same run.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    args = _parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # CPU only; accelerators are what they are
    from checkpoints.tiny_random import random_params

    config = _mixtral_config(args.experts)
    params = random_params(config)
    history, block_size = 256, 16
    width = -(-(history + 1) // block_size)
    print(
        f"{jax.device_count()} {jax.devices()[0].platform} devices; {config.num_experts} experts, top-2, "
        f"{config.num_layers} layers; decode over {history}-token histories"
    )
    base: dict[int, float] = {}
    for layout in args.layouts:
        ep, tp = map(int, layout.split("x"))
        runner = _runner(config, params, ep, tp, args.batches, width, block_size)
        for batch in args.batches:
            best = _best_step(runner, batch, history, width, block_size, args.reps)
            base.setdefault(batch, best)
            print(
                f"ep {ep} x tp {tp}: batch {batch}: {best * 1e3:.1f} ms/step ({batch / best:.0f} tok/s), "
                f"{best / base[batch]:.2f}x one device's time"
            )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "4x1", "2x2"], help="EPxTP")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    return parser.parse_args()


def _mixtral_config(num_experts: int):
    """The bench's Mixtral shape: top-2 of `num_experts` experts, 4 layers, hidden 512."""
    from checkpoints.tiny_random import tiny_random_config

    return tiny_random_config(
        architecture="mixtral",
        vocab_size=8192,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        num_experts=num_experts,
        num_experts_per_tok=2,
        intermediate_size=1024,
        moe_intermediate_size=1024,
    )


def _runner(config, params, ep: int, tp: int, batches: list[int], width: int, block_size: int):
    """A runner on the first ep x tp devices, with a decode bucket for each batch size."""
    from jaxserve.config import EngineConfig
    from jaxserve.config_resolution import resolve
    from jaxserve.runner import ModelRunner

    engine = EngineConfig(
        expert_parallel_size=ep,
        tensor_parallel_size=tp,
        num_blocks=max(batches) * width + 1,
        block_size=block_size,
        max_num_seqs=max(batches),
        max_model_len=width * block_size,
        decode_batch_buckets=tuple(batches),
        block_table_buckets=(width,),
    )
    return ModelRunner(config, params, resolve(engine, config))


def _best_step(runner, batch: int, history: int, width: int, block_size: int, reps: int) -> float:
    """Best seconds of `reps` decode steps of `batch` rows over `history`-token histories (after one that compiles)."""
    from bench.steps import chunks

    program = runner.inputs.decode(chunks(runner, batch, history, 1, block_size), batch, width)
    best = float("inf")
    for _ in range(reps + 1):  # the first run compiles
        t0 = time.perf_counter()
        runner.step_logits(program, warming_up=True).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    runner.inputs.batch.release_finished()  # the bench's requests never run: their batch rows come back
    return best


if __name__ == "__main__":
    main()
