"""Decode step time with LoRA adapters against base rows, adapter load times, memory per adapter.

    python3 -m bench.lora_steps [--batches 32] [--adapters 1 4 8] [--max-loras 8] [--rank 16] [--reps 5]

The default model's shape (SmolLM2-135M, 30 layers) with random weights in f32 (the GGUF is not
needed; time does not depend on the values). Two runners in the same run: one without LoRA, and
one with `--max-loras` LoRA slots of rank `--rank` (adapters on all seven projections). For each
batch size it times the compiled decode step (model and greedy sampling, no scheduler) over
histories of 256 tokens: base rows on both runners, then the rows spread round-robin over 1, 4, 8
adapters; each is printed with its ratio to the base rows on the runner without LoRA. Then an
adapter's load time from disk (PEFT safetensors -> host arrays) and from host to a LoRA slot, and
its bytes on disk, on the host and per LoRA slot.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def _write_adapter(directory: Path, config, rank: int, seed: int) -> Path:
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from jaxserve.lora.peft import MLP_MODULES, module_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, out) in module_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, fan_in), np.float32) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out, rank), np.float32) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(module_shapes(config))}
        )
    )
    return directory


def step_times(
    config,
    params,
    batch: int,
    adapter_counts: list[int],
    max_loras: int,
    rank: int,
    rounds: int,
    dtype: str = "float32",
    history: int = 256,
) -> tuple[list[tuple[str, float]], object, list]:
    """Best decode step seconds of `batch` rows: base rows on a runner without LoRA and on one with
    `max_loras` LoRA slots of rank `rank` (random adapters on all seven projections written into every
    LoRA slot), then rows spread round-robin over each of `adapter_counts` adapters; interleaved rounds.
    Returns the (label, seconds) rows, the LoRA runner and its host adapters."""
    block_size = 16
    width = -(-(history + 1) // block_size)
    plain, lora = _runners(config, params, batch, width, block_size, max_loras, rank, dtype)
    adapters = _random_adapters_in_every_slot(lora, config, max_loras, rank)
    cases = [
        ("base rows, runner without LoRA", plain, 0),
        ("base rows, LoRA runner", lora, 0),
        *((f"rows over {n} adapters, LoRA runner", lora, n) for n in adapter_counts),
    ]
    best = [float("inf")] * len(cases)
    for _ in range(rounds):  # a busy machine's noise falls on every case alike
        for i, (_, runner, n) in enumerate(cases):
            best[i] = min(best[i], _step_time(runner, batch, history, width, block_size, n))
    return [(label, t) for (label, _, _), t in zip(cases, best)], lora, adapters


def _runners(config, params, batch: int, width: int, block_size: int, max_loras: int, rank: int, dtype: str) -> tuple:
    """(a runner without LoRA, one with `max_loras` LoRA slots of rank `rank`), each for decode steps of
    `batch` rows over `width` blocks."""
    from jaxserve.config import EngineConfig
    from jaxserve.config_resolution import resolve
    from jaxserve.runner import ModelRunner

    engine = dict(
        num_blocks=batch * width + 1,
        block_size=block_size,
        max_num_seqs=batch,
        dtype=dtype,
        max_model_len=width * block_size,
        decode_batch_buckets=(batch,),
        block_table_buckets=(width,),
    )
    plain = ModelRunner(config, params, resolve(EngineConfig(**engine), config))
    lora_config = EngineConfig(**engine, enable_lora=True, max_loras=max_loras, max_lora_rank=rank)
    return plain, ModelRunner(config, params, resolve(lora_config, config))


def _random_adapters_in_every_slot(lora, config, max_loras: int, rank: int) -> list:
    """A random adapter on all seven projections written into each of the runner's LoRA slots; the host adapters."""
    import jax
    import numpy as np

    from jaxserve.lora.peft import LoraWeights, module_shapes

    rng = np.random.default_rng(0)
    adapters = []
    for lora_slot in range(max_loras):
        modules = {
            m: (
                (rng.standard_normal((config.num_layers, fan_in, rank), np.float32) * 0.01),
                (rng.standard_normal((config.num_layers, rank, out), np.float32) * 0.01),
            )
            for m, (fan_in, out) in module_shapes(config).items()
        }
        adapters.append(LoraWeights(rank, modules, bytes([lora_slot]) * 16))
        lora.write_lora_slot(lora_slot, adapters[-1])
    jax.block_until_ready(lora.state.adapters)
    return adapters


def _step_time(runner, batch: int, history: int, width: int, block_size: int, num_adapters: int) -> float:
    """Best decode step seconds of `batch` rows of `history` tokens, spread round-robin over
    `num_adapters` adapters (0: base rows)."""
    from bench.steps import chunks, timed

    rows = chunks(runner, batch, history, 1, block_size)
    for i, chunk in enumerate(rows):
        chunk.request.lora_slot = i % num_adapters if num_adapters else -1
    best = timed(runner, runner.inputs.decode(rows, batch, width), 1)
    runner.inputs.batch.release_finished()  # the bench's requests never run: their batch rows come back
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5, help="rounds over the cases")
    args = parser.parse_args()

    import jax

    from bench.gpu_check.shapes import SMOLLM2_135M
    from checkpoints.tiny_random import random_params
    from jaxserve.lora.peft import load_peft_adapter

    config = SMOLLM2_135M
    params = random_params(config)
    print(
        f"{jax.devices()[0].platform}: SmolLM2-135M shape, f32, decode over 256-token histories; "
        f"LoRA runner: {args.max_loras} LoRA slots of rank {args.rank} on all 7 projections"
    )
    for batch in args.batches:
        rows, lora, _ = step_times(config, params, batch, args.adapters, args.max_loras, args.rank, args.reps)
        for label, t in rows:
            print(
                f"batch {batch}: {label}: {t * 1e3:.1f} ms/step ({t / rows[0][1]:.2f}x the base rows without LoRA, "
                f"{t / rows[1][1]:.2f}x the LoRA runner's base rows)"
            )

    with tempfile.TemporaryDirectory() as tmp:
        paths = [_write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i) for i in range(args.max_loras)]
        t0 = time.perf_counter()
        adapters = [load_peft_adapter(str(p), config, args.rank) for p in paths]
        disk_s = (time.perf_counter() - t0) / len(paths)
        file_bytes = (paths[0] / "adapter_model.safetensors").stat().st_size
    t0 = time.perf_counter()
    for lora_slot, weights in enumerate(adapters):
        lora.write_lora_slot(lora_slot, weights)
        jax.block_until_ready(lora.state.adapters)
    device_s = (time.perf_counter() - t0) / len(adapters)
    print(f"adapter load, disk -> host: {disk_s * 1e3:.1f} ms; host -> LoRA slot: {device_s * 1e3:.1f} ms")
    print(
        f"memory per adapter (rank {args.rank}, 7 projections x {config.num_layers} layers): "
        f"file {file_bytes / 1e6:.1f} MB, host {adapters[0].nbytes / 1e6:.1f} MB, "
        f"LoRA slot {lora.lora_slots.bytes_per_lora_slot / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
