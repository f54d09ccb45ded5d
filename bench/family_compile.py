"""Compile time per model family: the engine's warm-up (every declared program variant) per model.

    python3 -m bench.family_compile [--models llama qwen2 qwen3 mistral gemma3 mixtral qwen3_moe] [--buckets test|serve]

A name of `checkpoints.tiny_random.TINY_FAMILIES` is that family's tiny random model; any other name
is a model spec (a registry name, a `.gguf` file, a directory), loaded as `jaxserve serve` loads it.
`--buckets serve` warms up the engine's default buckets (what `jaxserve serve` compiles), `test`
the small set the family tests use. JAX's persistent compilation cache is off, so every program
compiles here; each model's warm-up runs in a fresh process, one after the other (its time is
then not shortened by programs an earlier model left in memory). Prints one line per model: the
warm-up time, the programs compiled, and any compilation after a short generation (there should
be none).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

TEST_BUCKETS = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=96,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe")


def warm_up_one(name: str, buckets: str) -> dict[str, Any]:
    """Warm up an engine for `name` in this process; its warm-up time and compilations."""
    from checkpoints.tiny_random import TINY_FAMILIES, build_tiny_random
    from jaxserve import LLM, SamplingParams

    model: Any = build_tiny_random(family=name) if name in TINY_FAMILIES else name
    llm = LLM(model, **(TEST_BUCKETS if buckets == "test" else {}))
    compiled = llm.engine.num_compilations
    llm.generate(
        [[5, 6, 7, 8, 9, 10, 11, 12]] * 3,
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    config = llm.engine.model_config
    return {
        "model": name,
        "architecture": config.architecture,
        "layers": config.num_layers,
        "experts": config.num_experts,
        "warm_up_s": round(llm.warm_up_seconds, 2),
        "programs": compiled,
        "compilations_after_warm_up": llm.engine.num_compilations - compiled,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(FAMILIES), help="tiny family names or model specs")
    parser.add_argument("--buckets", choices=("test", "serve"), default="test")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: warm up this model
    args = parser.parse_args()
    if args.one:
        print(json.dumps(warm_up_one(args.one, args.buckets)))
        return
    for name in args.models:
        child = subprocess.run(
            [sys.executable, "-m", "bench.family_compile", "--buckets", args.buckets, "--one", name],
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode != 0:
            print(f"{name}: failed ({child.returncode}): {child.stderr.strip()[-800:]}")
            continue
        r = json.loads(child.stdout.strip().splitlines()[-1])
        print(
            f"{r['model']:<28} {r['architecture']:<10} {r['layers']:>3} layers {r['experts']:>3} experts: "
            f"warm-up {r['warm_up_s']:7.2f} s, {r['programs']} programs, "
            f"{r['compilations_after_warm_up']} compilations after warm-up",
            flush=True,
        )


if __name__ == "__main__":
    main()
