"""Resume a long conversation from each KV tier, same run: TTFT with a device, host and disk hit
against recomputing the prompt, plus the disk tier's write and read bandwidth against this
machine's (a plain large file written with fsync, then read back).

    python3 -m bench.kv_tiers [--model smollm2-135m-instruct] [--tokens 4000] [--dir DIR]

A hit computes its last tokens in the 32-token prefill bucket, so it does not pay a padded
512-token step. The disk hit is taken by a second engine on the same directory after the first
one closed (a restart: nothing on its device or host). Ratios come from one run; the machine is
shared.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from checkpoints.registry import cache_dir
from jaxserve import LLM, SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def ttft(llm: LLM, prompt: list[int], what: str) -> tuple[float, int]:
    """Seconds to the first token of `prompt` (generation stops there) and its cached tokens; printed
    as they come (a run on a busy machine is long)."""
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, ONE_TOKEN, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    print(f"{what}: TTFT {seconds:.3f} s, {out.num_cached_tokens} cached tokens", flush=True)
    return seconds, out.num_cached_tokens


def machine_disk_bandwidth(directory: Path, nbytes: int = 1 << 30) -> tuple[float, float]:
    """(write, read) bytes/s of one large file: written in 8 MiB pieces and fsynced, then read back
    (the read may come from the page cache, as the tier's reads of fresh files do)."""
    path = directory / "bandwidth.bin"
    piece = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(piece)):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass
    read = nbytes / (time.perf_counter() - t0)
    path.unlink()
    return write, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one)")
    args = parser.parse_args()
    bs = 16
    max_len = -(-(args.tokens + 64) // 512) * 512
    config = dict(max_num_seqs=1, max_num_batched_tokens=512, max_model_len=max_len, block_size=bs,
                  num_blocks=max_len // bs + 64, decode_batch_buckets=(1,), prefill_token_buckets=(32, 512),
                  prefill_seq_buckets=(1,), block_table_buckets=(max_len // bs,),
                  kv_host_bytes=1 << 30, kv_disk_bytes=4 << 30, compilation_cache_dir=str(cache_dir() / "xla"))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or tmp)
        rng = np.random.default_rng(0)
        conversation, other = (rng.integers(100, 40000, args.tokens).tolist() for _ in range(2))

        first = LLM(args.model, kv_disk_dir=str(directory), **config)
        cold, _ = ttft(first, conversation, "recompute (cold)")   # computed, written through to disk
        device, device_cached = ttft(first, conversation, "device hit")
        kv = first.engine.kv
        kv.prefix_cache.evict(kv.prefix_cache.num_evictable_blocks)   # spill everything to the host
        first.engine.step()                                       # run the spill copies
        host, host_cached = ttft(first, conversation, "host hit")
        first.engine.close()
        written = first.engine.snapshot().tiers

        second = LLM(args.model, kv_disk_dir=str(directory), **config)   # the restart
        recompute, _ = ttft(second, other, "recompute (after the restart)")
        disk, disk_cached = ttft(second, conversation, "disk hit (after the restart)")
        loaded = second.engine.snapshot().tiers
        second.engine.close()
        machine_write, machine_read = machine_disk_bandwidth(directory)

    tier_write = written.disk_bytes_written / written.disk_write_seconds if written.disk_write_seconds else 0.0
    tier_read = loaded.disk_bytes_read / loaded.disk_load_seconds if loaded.disk_load_seconds else 0.0
    result = {
        "prompt_tokens": args.tokens,
        "ttft_s": {"recompute_cold": round(cold, 3), "recompute_after_restart": round(recompute, 3),
                   "device_hit": round(device, 3), "host_hit": round(host, 3), "disk_hit_after_restart": round(disk, 3)},
        "cached_tokens": {"device": device_cached, "host": host_cached, "disk": disk_cached},
        "speedup_vs_recompute": {"device": round(recompute / device, 2), "host": round(recompute / host, 2),
                                 "disk": round(recompute / disk, 2)},
        "disk_tier_MBps": {"write": round(tier_write / 1e6), "read": round(tier_read / 1e6),
                           "bytes_written": written.disk_bytes_written, "bytes_read": loaded.disk_bytes_read},
        "machine_MBps": {"write_fsync": round(machine_write / 1e6), "read": round(machine_read / 1e6)},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
