"""Shared pieces of the sharding tests: tiny engine settings, prompts, a greedy driver for any
engine-like object, and a runner for the multi-device worker scripts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

HERE = pathlib.Path(__file__).parent
CACHE_ENV = "JAXSERVE_TEST_COMPILATION_CACHE"  # a worker's persistent compilation cache, if set

# One bucket per step kind (the sampler's too) keeps every engine at 3 step variants and 1 sampler.
TINY_ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    decode_batch_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
    sampler_row_buckets=(8,),
    block_table_buckets=(16,),
    num_blocks=128,
)

# Too few blocks for PROMPTS at once: requests are preempted and swapped to the host.
SWAP_ENGINE = {**TINY_ENGINE, "num_blocks": 20, "preemption_mode": "swap", "swap_space_blocks": 64}

# Lengths 5..70: single-block, multi-block, and one prompt longer than a 64-token step (chunked).
PROMPTS = [[3 + (7 * i + 5 * j) % 290 for j in range(n)] for i, n in enumerate((5, 17, 30, 70))]
NEW_TOKENS = 8

# XLA flags that halve a CPU compilation (LLVM's expensive passes off): for tests of what a layout
# computes, whose one-device reference is compiled with the same flags, not of how fast it runs.
QUICK_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def generate_greedy(
    engine: Any, prompts: list[list[int]], max_tokens: int = NEW_TOKENS, prefix: str = "p"
) -> list[list[int]]:
    """Greedy token ids per prompt, driving `add_request`/`step` of an engine or a data-parallel engine."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.request_id in out:  # other requests may share the engine
                out[d.request_id].extend(d.token_ids)
    return [out[rid] for rid in ids]


def run_worker(
    script: str,
    *args: str,
    devices: int = 8,
    timeout: int = 600,
    env: dict[str, str] | None = None,
    xla_flags: str = "",
) -> dict:
    """Run `script` in a fresh interpreter with `devices` simulated CPU devices (and `xla_flags`);
    return the JSON object it prints on its last stdout line."""
    full_env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip(),
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        cwd=HERE,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
