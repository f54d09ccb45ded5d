"""Run by test_default_model_tp.py with 3 simulated CPU devices: the default model
(SmolLM2-135M, 9 query heads, 3 kv heads) on one device and at tp=3, on a short chat prompt.

Prints one JSON line: greedy tokens and the largest logit difference of the runner's prefill
and decode steps between the two, compilation counts, and per-device bytes of parameters and
KV cache read from the arrays' shards.
"""

from __future__ import annotations

import json
from collections import Counter

import jax
import numpy as np
from mesh_cases import TINY_ENGINE, generate_greedy
from tp_worker import step_logits

from checkpoints.registry import DEFAULT_MODEL, load_model
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine


def bytes_per_device(tree) -> dict[int, int]:
    total: Counter = Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            total[shard.device.id] += shard.data.nbytes
    return dict(sorted(total.items()))


def main() -> None:
    assert len(jax.devices()) == 3, jax.devices()
    model = load_model(DEFAULT_MODEL)
    prompt = model.tokenizer_bundle.tokenizer.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ).ids
    results = {}
    for tp in (1, 3):
        engine = LLMEngine(model, EngineConfig(tensor_parallel_size=tp, **TINY_ENGINE))
        engine.warm_up()
        warm = engine.num_compilations
        prefill, decode = step_logits(engine.runner, [prompt])
        results[tp] = {
            "tokens": generate_greedy(engine, [prompt], max_tokens=8)[0],
            "prefill": np.asarray(prefill),
            "decode": np.asarray(decode),
            "compilations": [warm, engine.num_compilations],
            "param_bytes_per_device": bytes_per_device(engine.runner.params),
            "cache_bytes_per_device": bytes_per_device(engine.runner.cache),
            "cache_shard_shape": list(engine.runner.cache.k.addressable_shards[0].data.shape),
        }
        del engine
    one, three = results[1], results[3]
    print(
        json.dumps(
            {
                "prompt_tokens": len(prompt),
                "tokens": {tp: r["tokens"] for tp, r in results.items()},
                "max_abs_logit_diff": float(
                    max(np.abs(one["prefill"] - three["prefill"]).max(), np.abs(one["decode"] - three["decode"]).max())
                ),
                "max_abs_logit": float(np.abs(one["prefill"]).max()),
                **{
                    key: {tp: r[key] for tp, r in results.items()}
                    for key in ("compilations", "param_bytes_per_device", "cache_bytes_per_device", "cache_shard_shape")
                },
            }
        )
    )


if __name__ == "__main__":
    main()
