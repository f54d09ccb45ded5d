"""Reading a LoRA adapter saved by PEFT: `adapter_config.json` and `adapter_model.safetensors`.

PEFT stores, per targeted projection of layer i, `lora_A.weight` [r, in] and `lora_B.weight`
[out, r] under `base_model.model.model.layers.{i}.self_attn.q_proj.` (`mlp.` for gate/up/down),
and the update is (alpha / r) * B @ A (alpha / sqrt(r) with `use_rslora`). An adapter becomes
`LoraWeights`: per targeted module A [L, in, r] and B [L, r, out] in this model's layout
([in, out] kernels), the scaling folded into B, rank zero-padded to the runner's rank (a zero
column of A and row of B add nothing). Layers the adapter leaves out hold zeros.

What this engine cannot apply exactly is refused with a ValueError (DoRA, bias training,
modules_to_save, per-module rank or alpha patterns, fan_in_fan_out, unknown targets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import numpy as np

from checkpoints.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")  # PEFT paths them under `mlp.`, the others `self_attn.`
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target in a `config` model (the
    attention ones only in a mixture-of-experts model, whose MLPs are experts)."""
    hidden, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    if not config.num_experts:
        inter = config.intermediate_size
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """One adapter on the host, in the runner's layout (see the module docstring).

    digest: a hash of its configuration and tensors; KV computed with it is keyed by it, so the
    same bytes loaded again (under any name) find their cached prefixes and other bytes never do.
    """

    rank: int  # its own rank (before padding)
    modules: dict[str, tuple[np.ndarray, np.ndarray]]  # module -> (A [L, in, R], B [L, R, out])
    digest: bytes

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def _fail(path: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {why}")


def read_adapter_config(path: str) -> dict:
    """The adapter's PEFT config; ValueError when `path` is not a PEFT LoRA adapter directory."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise _fail(path, "no such directory")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise _fail(path, f"missing {os.path.basename(needed)}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(path, f"unreadable {CONFIG_FILE}: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    return config


def _targets(path: str, config: dict, supported: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT: a regular expression matched in full against module paths
        names = tuple(
            m
            for m in supported
            if re.fullmatch(targets, f"model.layers.0.{'mlp' if m in MLP_MODULES else 'self_attn'}.{m}")
        )
    elif isinstance(targets, list) and targets:
        names = tuple(targets)
    else:
        raise _fail(path, f"target_modules must be a list of module names, got {targets!r}")
    unknown = sorted(set(names) - set(supported))
    if unknown:
        raise _fail(path, f"cannot target {unknown}: this model's adapters may target {sorted(supported)}")
    return names


def _check_options(path: str, config: dict) -> None:
    checks = {
        "use_dora": (False, None),
        "fan_in_fan_out": (False, None),
        "bias": ("none", None),
        "modules_to_save": (None, []),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
    }
    for key, allowed in checks.items():
        if config.get(key, allowed[0]) not in allowed:
            raise _fail(path, f"{key}={config[key]!r} is not supported")


def load_peft_adapter(path: str, config: ModelConfig, max_rank: int) -> LoraWeights:
    """The adapter at `path` (a PEFT directory) for a `config` model, padded to rank `max_rank`.
    ValueError for anything that does not fit (see the module docstring)."""
    peft = read_adapter_config(path)
    _check_options(path, peft)
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise _fail(path, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(path, f"rank {rank} is above --max-lora-rank {max_rank}")
    scaling = float(alpha) / (math.sqrt(rank) if peft.get("use_rslora") else rank)
    shapes = module_shapes(config)
    targets = _targets(path, peft, shapes)
    # Imported here: the engine imports this module, and the GPU check's machine has no safetensors.
    from safetensors.numpy import load_file

    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise _fail(path, f"unreadable {WEIGHTS_FILE}: {e}") from e
    layers = config.num_layers
    modules = {
        m: (
            np.zeros((layers, shapes[m][0], max_rank), np.float32),
            np.zeros((layers, max_rank, shapes[m][1]), np.float32),
        )
        for m in targets
    }
    digest = hashlib.blake2b(json.dumps(peft, sort_keys=True).encode(), digest_size=16)
    for name in sorted(tensors):
        match = _TENSOR.match(name)
        if match is None:
            raise _fail(path, f"unexpected tensor {name!r}")
        layer, module, which = int(match[1]), match[3], match[4]
        if module not in modules or layer >= layers:
            raise _fail(path, f"tensor {name!r} is outside its target modules or the model's {layers} layers")
        fan_in, features = shapes[module]
        x = np.asarray(tensors[name], np.float32)
        want = (rank, fan_in) if which == "A" else (features, rank)
        if x.shape != want:
            raise _fail(path, f"{name} has shape {x.shape}, expected {want}")
        a, b = modules[module]
        if which == "A":
            a[layer, :, :rank] = x.T
        else:
            b[layer, :rank, :] = x.T * scaling
        digest.update(name.encode())
        digest.update(x.tobytes())
    return LoraWeights(rank, modules, digest.digest())
