"""Per-device memory and communication of tensor parallelism, read from the arrays and the HLO.

    python3 -m bench.mesh_report [--model smollm2-135m-instruct] [--tp 1 3] [--num-blocks 128]

For each tensor-parallel size it builds an engine on the first tp devices (on a CPU-only
machine the CPU is split into max(tp) devices), then prints, per device, the bytes of the
parameters and of the KV cache (summed over the shards each device holds), and the
collectives of the compiled decode step: the row-parallel all-reduces inside the layer loop
and what runs once per step.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import jax


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Bytes each device holds of the arrays in `tree` (device id -> bytes)."""
    held: collections.Counter[int] = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return dict(held)


def report(model: str, tp: int, num_blocks: int, block_size: int, batch: int) -> dict[str, Any]:
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from sharding.hlo import collectives

    config = EngineConfig(
        tensor_parallel_size=tp,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=num_blocks // 2 * block_size,
    )
    engine = LLMEngine(model, config)
    runner = engine.runner
    width = config.block_table_buckets[-1]
    args = runner.step_args(runner.inputs.decode([], batch, width))  # one decode bucket is enough to read its HLO
    found = collectives(runner.executables.programs["decode"].lower(*args).compile().as_text())
    return {
        "tp": tp,
        "served_kv_heads": runner.config.num_kv_heads,
        "params": bytes_per_device(runner.params),
        "kv_cache": bytes_per_device(runner.cache),
        "decode_collectives": found,
        "decode_bucket": (batch, width),
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def main(argv: list[str] | None = None) -> None:
    from checkpoints.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--num-blocks", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="decode batch of the step whose HLO is read")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", max(args.tp))  # CPU only; accelerators are what they are
    print(f"{args.model}: {args.num_blocks} KV blocks of {args.block_size} tokens; devices: {jax.devices()}")
    for tp in args.tp:
        r = report(args.model, tp, args.num_blocks, args.block_size, args.batch)
        params, cache = r["params"], r["kv_cache"]
        print(f"\ntp={tp} ({r['served_kv_heads']} kv heads served)")
        for device in sorted(params):
            print(f"  device {device}: parameters {_mb(params[device])}, KV cache {_mb(cache.get(device, 0))}")
        in_loop = collections.Counter(
            (c.op, c.shape.split("{")[0], c.module) for c in r["decode_collectives"] if c.in_layer_loop
        )
        once = collections.Counter(
            (c.op, c.shape.split("{")[0], c.module) for c in r["decode_collectives"] if not c.in_layer_loop
        )
        print(
            f"  decode step {r['decode_bucket']} collectives per layer: "
            f"{dict(in_loop) or 'none'}; once per step: {dict(once) or 'none'}"
        )


if __name__ == "__main__":
    main()
