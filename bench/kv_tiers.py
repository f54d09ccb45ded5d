"""Resume a long conversation from each KV tier, same run: TTFT with a device, host and disk hit
against recomputing the prompt; the disk tier's write and read bandwidth against this machine's;
and what a background disk load costs the requests decoding meanwhile.

    python3 -m bench.kv_tiers [--model smollm2-135m-instruct] [--tokens 4000] [--dir DIR] [--decoders 3]

Three parts, one run (the machine is shared: compare the ratios, not the seconds):
1. TTFT of one `--tokens` prompt (max_tokens=1): computed cold, then hit on the device, then on
   the host tier (everything evicted to it), all in a first engine that is then closed (a clean
   shutdown: its blocks are on disk). A second engine on the same directory (the restart) then
   recomputes a fresh prompt of the same length, and takes disk hits: one whose files were
   dropped from the OS page cache first (`posix_fadvise DONTNEED` after a sync: read from the
   device) and one whose files are still in the page cache (as after a quick restart).
2. Bandwidth: the tier's (bytes over the writer's and loader's busy time; files are written
   without fsync and read with checksums and a copy into the host tier) against one large file
   written with and without fsync and read from the page cache and, after DONTNEED, from the disk.
3. Decode steps of `--decoders` running requests: alone, while a disk hit of a `--tokens` prompt
   loads in the background (page cache dropped), and while such a prompt is recomputed instead.
4. Short hits (`--kv-disk-min-load-tokens`'s crossover): TTFT of prompts of 32 ... 512 tokens
   whose blocks but the last are on disk (in the page cache), loaded, against recomputing a fresh
   prompt of the same length (each in its own prefill bucket, so neither pays for padding).

A hit computes its last tokens in the 32-token prefill bucket, so it does not pay a padded
512-token step. Each TTFT also reports its first token: every path must produce the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.kv_tier_report import from_tier_stats
from checkpoints.registry import cache_dir
from jaxserve import LLM, SamplingParams
from jaxserve.kv.content_keys import chain_keys
from jaxserve.kv.tier_stats import TierStats

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
PIECE = 8 << 20
SHORT_PROMPTS = (32, 64, 128, 256, 512)  # part 4's prompt lengths, each a prefill bucket


def ttft(llm: LLM, prompt: list[int], what: str) -> dict[str, Any]:
    """Seconds to the first token of `prompt` (generation stops there), its cached tokens, the token,
    and the KV tier counters of the request; printed as they come (a run on a busy machine is long)."""
    before = llm.engine.snapshot().tiers
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt}, ONE_TOKEN, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    tiers = from_tier_stats(before, llm.engine.snapshot().tiers)
    print(f"{what}: TTFT {seconds:.3f} s, {out.num_cached_tokens} cached tokens; tiers {json.dumps(tiers)}", flush=True)
    return {
        "ttft_s": seconds,
        "cached_tokens": out.num_cached_tokens,
        "first_token": out.outputs[0].token_ids[0],
        "tiers": tiers,
    }


def drop_from_page_cache(paths: list[Path]) -> None:
    """Make the next read of these files come from the disk: write back their dirty pages, then tell
    the kernel their cached pages are not needed (no root needed, unlike drop_caches)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def block_paths(llm: LLM, prompt: list[int]) -> list[Path]:
    """The disk tier's files of the full blocks of `prompt`."""
    disk = llm.engine.lower_tier
    keys = chain_keys(disk.fingerprint, prompt, len(prompt) // disk.block_size, disk.block_size)
    return [disk.path(key) for key in keys if disk.path(key).exists()]


def machine_disk_bandwidth(directory: Path, nbytes: int) -> dict[str, float]:
    """MB/s of one large file written in 8 MiB pieces (without and with fsync) and read back in
    8 MiB pieces from the page cache and, after dropping it from there, from the disk."""
    path = directory / "bandwidth.bin"
    piece = np.random.default_rng(0).integers(0, 255, PIECE, dtype=np.uint8).tobytes()
    out = {}
    for name, sync in (("write_MB_per_s", False), ("write_fsync_MB_per_s", True)):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(nbytes // PIECE):
                f.write(piece)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        out[name] = nbytes / (time.perf_counter() - t0) / 1e6
    for name, cold in (("read_page_cache_MB_per_s", False), ("read_disk_MB_per_s", True)):
        if cold:
            drop_from_page_cache([path])
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(PIECE)
            while f.readinto(buf):
                pass
        out[name] = nbytes / (time.perf_counter() - t0) / 1e6
    path.unlink()
    return out


def decode_steps(
    llm: LLM,
    decoders: list[list[int]],
    extra: list[int] | None,
    what: str,
    done: Callable[[Any, str], bool],
    drop_last: bool = False,
    max_steps: int = 40,
) -> dict[str, Any]:
    """Steps of the engine while `decoders` decode: `max_steps` of them alone (extra None), or from
    adding `extra` (max_tokens=1) until `done(engine, its id)` after a step (`drop_last`: that step
    is not counted). Returns the mean step time and the decoders' tokens per second over the steps,
    and the KV tier counters of the whole phase."""
    engine = llm.engine
    params = SamplingParams(
        max_tokens=engine.config.max_model_len - max(map(len, decoders)) - 1, temperature=0.0, ignore_eos=True
    )
    ids = [f"{what}-decoder{i}" for i in range(len(decoders))]
    for rid, prompt in zip(ids, decoders):
        engine.add_prompt_ids(rid, prompt, params)
    while engine.scheduler.waiting or any(r.is_prefilling for r in engine.scheduler.running):
        engine.step()  # prefill the decoders first
    for _ in range(3):
        engine.step()
    extra_id = f"{what}-extra"
    before = engine.snapshot().tiers
    if extra is not None:
        engine.add_prompt_ids(extra_id, extra, ONE_TOKEN)
    times, tokens = [], []
    while (len(times) < max_steps) if extra is None else not done(engine, extra_id):
        t0 = time.perf_counter()
        deltas = engine.step()
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(d.token_ids) for d in deltas if d.request_id in ids))
    if drop_last and times:
        times, tokens = times[:-1], tokens[:-1]
    tiers = from_tier_stats(before, engine.snapshot().tiers)
    for rid in ids + ([extra_id] if extra is not None else []):
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    result = {
        "steps": len(times),
        "mean_step_ms": float(np.mean(times) * 1e3) if times else None,
        "decode_tokens_per_s": sum(tokens) / sum(times) if times else None,
        "seconds": sum(times),
        "disk_loads": tiers["disk_loads"],
        "disk_mean_load_ms": tiers["disk_mean_load_ms"],
        "disk_hit_tokens": tiers["disk_hit_tokens"],
    }
    print(f"decode steps, {what}: {json.dumps(result)}", flush=True)
    return result


def _admitted(engine: Any, rid: str) -> bool:
    """No longer waiting: a loading request waits until its blocks are on the host tier."""
    return not any(r.request_id == rid for r in engine.scheduler.waiting)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one under /var/tmp)")
    parser.add_argument("--decoders", type=int, default=3, help="requests decoding during a load (part 3)")
    parser.add_argument("--bandwidth-bytes", type=int, default=512 << 20, help="size of the machine's test file")
    return parser.parse_args()


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    bs = 16
    max_len = -(-(args.tokens + 64) // 512) * 512
    seqs = args.decoders + 1
    return dict(
        max_num_seqs=seqs,
        max_num_batched_tokens=512,
        max_model_len=max_len,
        block_size=bs,
        num_blocks=2 * max_len // bs + 64,
        decode_batch_buckets=(seqs,),
        prefill_token_buckets=SHORT_PROMPTS,
        prefill_seq_buckets=(1,),
        max_prefill_seqs=1,
        kv_host_bytes=1 << 30,
        kv_disk_bytes=4 << 30,
        compilation_cache_dir=str(cache_dir() / "xla"),
    )


def _prompts(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Random token prompts: five of `--tokens`, the decoders' and the short ones (twice each length)."""
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(min(100, vocab // 2), min(40000, vocab), n).tolist()

    prompts: dict[str, Any] = {
        name: tokens(args.tokens) for name in ("conversation", "warm", "loaded", "fresh", "recomputed")
    }
    prompts["decoders"] = [tokens(32) for _ in range(args.decoders)]
    prompts["shorts"], prompts["short_fresh"] = ({n: tokens(n) for n in SHORT_PROMPTS} for _ in range(2))
    return prompts


def _before_restart(first: LLM, prompts: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """Cold, device and host hits; more prompts written to the disk. Returns the disk writes' figures."""
    conversation = prompts["conversation"]
    runs["recompute_cold"] = ttft(first, conversation, "recompute (cold)")  # written through to disk
    first.engine.step()  # runs the write-through copies the cold run planned ...
    first.engine.lower_tier.flush()  # ... and waits for the files, so the next TTFT does not share the CPU
    runs["device_hit"] = ttft(first, conversation, "device hit")
    kv = first.engine.kv
    kv.prefix_cache.evict(kv.prefix_cache.num_evictable_blocks)  # spill everything to the host
    first.engine.step()  # run the spill copies
    runs["host_hit"] = ttft(first, conversation, "host hit")
    for prompt in (prompts["warm"], prompts["loaded"], *prompts["shorts"].values()):  # more prompts for the disk
        first.generate({"prompt_token_ids": prompt}, ONE_TOKEN, use_tqdm=False)
    first.close()
    return from_tier_stats(TierStats(), first.engine.snapshot().tiers)


def _after_restart(second: LLM, prompts: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """Disk hits read from the disk and from the page cache, decode steps during a load and a
    recompute, and short prompts' hits against their recompute."""
    drop_from_page_cache(block_paths(second, prompts["conversation"]) + block_paths(second, prompts["loaded"]))
    runs["recompute_after_restart"] = ttft(second, prompts["fresh"], "recompute (after the restart)")
    second.engine.lower_tier.flush()
    os.sync()  # the recompute's files reach the disk now, not in the kernel's writeback during the next read
    runs["disk_hit_from_disk"] = ttft(second, prompts["conversation"], "disk hit, files read from the disk")
    for path in block_paths(second, prompts["warm"]):
        path.read_bytes()  # surely in the page cache
    runs["disk_hit_from_page_cache"] = ttft(second, prompts["warm"], "disk hit, files in the page cache")
    decoders = prompts["decoders"]
    steps = {
        "alone": decode_steps(second, decoders, None, "alone", _admitted),
        "during_load": decode_steps(second, decoders, prompts["loaded"], "during a disk load", _admitted, True),
        "during_recompute": decode_steps(
            second, decoders, prompts["recomputed"], "during a recompute", lambda e, rid: not e.is_active(rid)
        ),
    }
    short = {}
    for n in SHORT_PROMPTS:
        for path in block_paths(second, prompts["shorts"][n]):
            path.read_bytes()
        short[n] = {
            "recompute": ttft(second, prompts["short_fresh"][n], f"{n} tokens, recompute"),
            "disk_hit": ttft(second, prompts["shorts"][n], f"{n} tokens, disk hit (page cache)"),
        }
    second.close()
    return {"steps": steps, "short": short}


def main() -> None:
    args = _parse_args()
    config = _engine_config(args)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:  # /var/tmp: a disk, not a tmpfs
        directory = Path(args.dir or tmp)
        first = LLM(args.model, kv_disk_dir=str(directory), **config)
        model = first.engine.model_config
        prompts = _prompts(args, model.vocab_size)
        print(
            f"model: max_position_embeddings {model.max_position_embeddings}, rope_theta {model.rope_theta}, "
            f"rope_scaling {model.rope_scaling}; max_model_len {first.engine.config.max_model_len}",
            flush=True,
        )
        written = _before_restart(first, prompts, runs)
        # The restart; every disk hit loads, however short (part 4 measures where that pays).
        second = LLM(args.model, kv_disk_dir=str(directory), kv_disk_min_load_tokens=1, **config)
        after = _after_restart(second, prompts, runs)
        machine = machine_disk_bandwidth(directory, args.bandwidth_bytes)
    print(json.dumps(_summary(args, runs, written, after, machine), indent=2, default=float))


def _summary(
    args: argparse.Namespace, runs: dict[str, Any], written: dict[str, Any], after: dict[str, Any], machine: Any
) -> dict[str, Any]:
    recompute = runs["recompute_after_restart"]["ttft_s"]
    first_tokens = {name: r["first_token"] for name, r in runs.items()}
    same = (
        first_tokens["recompute_cold"]
        == first_tokens["device_hit"]
        == first_tokens["host_hit"]
        == first_tokens["disk_hit_from_disk"]
    )
    steps = after["steps"]
    alone, during_load, during_recompute = steps["alone"], steps["during_load"], steps["during_recompute"]
    return {
        "prompt_tokens": args.tokens,
        "ttft_s": {name: round(r["ttft_s"], 3) for name, r in runs.items()},
        "cached_tokens": {name: r["cached_tokens"] for name, r in runs.items()},
        "speedup_vs_recompute_after_restart": {name: round(recompute / r["ttft_s"], 2) for name, r in runs.items()},
        "same_first_token_on_every_path": same,
        "disk_tier": {
            "write_MB_per_s": written["disk_write_MB_per_s"],
            "bytes_written": written["disk_bytes_written"],
            "read_from_disk": runs["disk_hit_from_disk"]["tiers"],
            "read_from_page_cache": runs["disk_hit_from_page_cache"]["tiers"],
        },
        "machine_disk": machine,
        "decode_steps": {
            "decoders": args.decoders,
            "alone": alone,
            "during_disk_load": during_load,
            "during_recompute": during_recompute,
            "step_time_ratio_load_vs_alone": _ratio(during_load, alone, "mean_step_ms"),
            "step_time_ratio_recompute_vs_alone": _ratio(during_recompute, alone, "mean_step_ms"),
            "tokens_per_s_ratio_load_vs_alone": _ratio(during_load, alone, "decode_tokens_per_s"),
        },
        "short_hits": {
            n: {
                "recompute_ttft_s": round(r["recompute"]["ttft_s"], 4),
                "disk_hit_ttft_s": round(r["disk_hit"]["ttft_s"], 4),
                "disk_hit_tokens": r["disk_hit"]["tiers"]["disk_hit_tokens"],
                "speedup": round(r["recompute"]["ttft_s"] / r["disk_hit"]["ttft_s"], 2),
            }
            for n, r in after["short"].items()
        },
    }


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None


if __name__ == "__main__":
    main()
