"""Run by test_lora_tensor_parallel.py in a subprocess with 4 simulated CPU devices: the tiny
model's LoRA engine with --tensor-parallel-size 4 (its 2 kv heads served as 4: the adapters' k/v
updates are repeated like the base projections), every reference case in one mixed batch. Prints
one JSON line: the tokens, the reference's, compilations after warm-up, and the LoRA slots' shardings."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_harness import LORA_ENGINE, TINY_ADAPTERS, reference_runs, write_tiny_adapters  # noqa: E402

from checkpoints.tiny_random import build_tiny_random  # noqa: E402
from jaxserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_tiny_adapters(Path(tmp))
        llm = LLM(build_tiny_random(), **LORA_ENGINE, tensor_parallel_size=4)
        for spec in TINY_ADAPTERS:
            llm.engine.add_lora(spec.name, str(adapters[spec.name]))
        compiled = llm.engine.num_compilations
        runs = reference_runs()
        outs = llm.generate(
            [{"prompt_token_ids": p} for _, p, _ in runs],
            [SamplingParams(max_tokens=len(t), temperature=0.0, ignore_eos=True, lora=n) for n, _, t in runs],
            use_tqdm=False,
        )
    stacks = llm.engine.runner.state.adapters
    print(
        json.dumps(
            {
                "tokens": [o.outputs[0].token_ids for o in outs],
                "expected": [t for _, _, t in runs],
                "new_compilations": llm.engine.num_compilations - compiled,
                "kv_replicas": llm.engine.runner.lora_slots.kv_replicas,
                "specs": {
                    f"{m}/{k}": str(stacks[m][k].sharding.spec)
                    for m in ("q_proj", "k_proj", "o_proj", "down_proj")
                    for k in ("a", "b")
                },
            }
        )
    )


if __name__ == "__main__":
    main()
