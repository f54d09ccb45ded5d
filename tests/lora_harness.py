"""Shared by the LoRA tests (engine, server, router): the tiny model's LoRA engine settings (the
same everywhere, so the run's persistent compilation cache compiles them once), its adapters
written at test time, and their transformers + PEFT reference (tests/data/lora_reference.json)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from checkpoints.tiny_random import build_tiny_random

sys.path.insert(0, str(Path(__file__).parent / "data"))
from lora_adapters import TINY_ADAPTERS, AdapterSpec, module_features, write_adapter  # noqa: E402

REFERENCE = json.loads((Path(__file__).parent / "data" / "lora_reference.json").read_text())["tiny"]
LORA_ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=160,
    decode_batch_buckets=(8,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(16,),
    enable_lora=True,
    max_loras=4,
    max_lora_rank=16,
    max_cpu_loras=5,
)
# A fifth adapter: one more than the LoRA slots.
EXTRA = AdapterSpec("extra-r2", 2, 2.0, ("o_proj", "down_proj"), seed=5)
ALL_ADAPTERS = (*TINY_ADAPTERS, EXTRA)


def write_tiny_adapters(root: Path) -> dict[str, Path]:
    """Every adapter of ALL_ADAPTERS as a PEFT directory under `root`, checked against the bytes
    the reference was made from."""
    config = build_tiny_random().config
    features = module_features(
        config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim
    )
    paths = {spec.name: write_adapter(root / spec.name, spec, config.num_layers, features) for spec in ALL_ADAPTERS}
    for name, entry in REFERENCE["adapters"].items():
        digest = hashlib.sha256((paths[name] / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert digest == entry["adapter_sha256"], f"{name}: the adapter's bytes differ from the reference's"
    return paths


def reference_runs() -> list[tuple[str | None, list[int], list[int]]]:
    """(adapter or None for the base model, prompt ids, reference greedy ids) of every case."""
    runs = [(None, c) for c in REFERENCE["base"]["cases"]]
    runs += [(name, c) for name, entry in REFERENCE["adapters"].items() for c in entry["cases"]]
    return [(name, c["prompt_ids"], c["new_ids"]) for name, c in runs]
