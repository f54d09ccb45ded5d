"""Engine settings for the bench tests that run the tiny-random engine: few shape buckets, fast warm-up."""

from __future__ import annotations

SMALL_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128, "max_prefill_seqs": 1}


def engine_flags(config: dict) -> list[str]:
    """`{"max_num_seqs": 4}` -> `["--max-num-seqs", "4"]` (the CLI's flags for EngineConfig fields)."""
    return [item for key, value in config.items() for item in (f"--{key.replace('_', '-')}", str(value))]
