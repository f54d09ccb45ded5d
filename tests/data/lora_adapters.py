"""Random LoRA adapters in PEFT's format, the same bytes for every caller.

Both the tests (jaxserve's interpreter) and tests/data/make_lora_reference.py (the reference venv,
which feeds them to PEFT) write adapters with `write_adapter`; it needs only numpy and safetensors.
Each adapter's A and B are drawn from a seeded generator (B non-zero, unlike PEFT's default
initialization, so every adapter changes the model's output).

Adapters are described by `AdapterSpec`: rank, alpha, rsLoRA, target modules, seed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int
    rslora: bool = False
    scale: float = 0.1  # standard deviation of A and B's entries


# The tiny model's adapters: ranks 4-16, attention only, MLP only, all seven, rsLoRA.
TINY_ADAPTERS = (
    AdapterSpec("attn-r8", 8, 16.0, ATTENTION, seed=1),
    AdapterSpec("mlp-r4", 4, 8.0, MLP, seed=2),
    AdapterSpec("all-r16", 16, 16.0, ATTENTION + MLP, seed=3),
    AdapterSpec("qv-rs", 8, 4.0, ("q_proj", "v_proj"), seed=4, rslora=True),
)

# The default model's (SmolLM2-135M): small entries, so the adapted model still writes text.
DEFAULT_ADAPTERS = (
    AdapterSpec("smol-all-r8", 8, 16.0, ATTENTION + MLP, seed=11, scale=0.03),
    AdapterSpec("smol-qkvo-r16", 16, 32.0, ATTENTION, seed=12, rslora=True, scale=0.03),
)


def module_features(
    hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama-shaped layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def write_adapter(directory: Path, spec: AdapterSpec, num_layers: int, features: dict[str, tuple[int, int]]) -> Path:
    """Write `spec` as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    tensors = {}
    for layer in range(num_layers):
        for module in spec.targets:
            fan_in, out = features[module]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in MLP else 'self_attn'}.{module}"
            a = rng.standard_normal((spec.rank, fan_in)) * spec.scale
            b = rng.standard_normal((out, spec.rank)) * spec.scale
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = (
                a.astype(np.float32),
                b.astype(np.float32),
            )
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.targets),
        "use_rslora": spec.rslora,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return directory
