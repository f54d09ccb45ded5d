"""Run by test_quantized_tp.py in a subprocess with 8 simulated CPU devices: the tiny model with
int8 weights (`--quantization int8`) at tp=1 and tp=2, greedy tokens of each and the shardings
of the quantized arrays read back from the runner's parameters, as one JSON line."""

from __future__ import annotations

import json

from mesh_cases import PROMPTS, TINY_ENGINE, generate_greedy

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import make_engine


def main() -> None:
    model = build_tiny_random()
    out = {}
    for tp in (1, 2):
        engine = make_engine(
            model, EngineConfig(**TINY_ENGINE, dtype="float32", quantization="int8", tensor_parallel_size=tp)
        )
        layers = engine.runner.params["layers"]
        out[f"tp{tp}"] = {
            "tokens": generate_greedy(engine, PROMPTS),
            "specs": {
                f"{name}/{leaf}": list(layers[name][leaf].sharding.spec)
                for name in ("q_proj", "o_proj")
                for leaf in ("kernel", "kernel_scale")
            },
            "dtypes": {name: str(layers[name]["kernel"].dtype) for name in ("q_proj", "down_proj")},
            "head_specs": {
                leaf: list(engine.runner.params["lm_head"][leaf].sharding.spec) for leaf in ("kernel", "kernel_scale")
            },
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
