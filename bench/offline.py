"""`jaxserve bench throughput` and `jaxserve bench latency`: the offline engine, no HTTP.

throughput: the whole workload through `LLM.generate` at once (the engine batches it as it
likes); warm-up (compilation) is excluded and reported separately, as are the compilations that
happened during the run (there should be none).
latency: one request at a time: prefill time (a 1-token request) and the time of a full request;
the decode time per token is their difference over (output_len - 1). Every iteration uses a fresh
prompt, so no engine can answer from a prefix cache.
Both run the same prompts and weights through a peer afterwards, when one is asked for.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.kv_tier_report import from_tier_stats
from bench.model_files import gguf_path, special_token_ids
from bench.peers.runner import run_offline_peer
from bench.report import OURS, with_ratios
from bench.spec_report import from_snapshots
from bench.system_info import system_info
from bench.workloads import BenchRequest, TokenizerLike, TokenSampler, Workload


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    name: str  # transformers | llama-cpp
    python: str | None = None  # interpreter to run it in (default: this one)
    threads: int = 2
    batch_size: int = 32  # transformers' generate batch
    dtype: str = "float32"  # transformers' compute dtype (float32 | bfloat16)


def _jaxserve_llm(model: str, engine_args: dict[str, Any]):
    from jaxserve import LLM

    return LLM(model, **engine_args)


def _prompt(request: BenchRequest) -> dict[str, Any] | str:
    return {"prompt_token_ids": request.prompt} if isinstance(request.prompt, list) else request.prompt


def _engine_counters(llm) -> dict[str, float]:
    stats = {k: v for k, v in dataclasses.asdict(llm.engine.stats).items() if isinstance(v, int | float)}
    stats["num_compilations"] = llm.engine.num_compilations
    return stats


def measure_throughput(
    llm, requests: list[BenchRequest], ignore_eos: bool = True, show_progress: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run every request through `llm.generate`; returns rates and engine counters, and the KV
    tier counters of the run."""
    from jaxserve import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=ignore_eos) for r in requests]
    before, snapshot_before = _engine_counters(llm), llm.engine.snapshot()
    t0 = time.perf_counter()
    outputs = llm.generate([_prompt(r) for r in requests], params, use_tqdm=show_progress)
    elapsed = time.perf_counter() - t0
    after, snapshot_after = _engine_counters(llm), llm.engine.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "prompt_tokens_computed": int(delta["prompt_tokens_computed"]),
        "engine_steps": int(delta["num_steps"]),
        "model_time_s": delta["model_time"],
        "host_time_s": delta["step_time"] - delta["model_time"],
        "compilations_during_run": int(delta["num_compilations"]),
        # speculative decoding (none without it)
        **{f"spec_{k}": v for k, v in (from_snapshots(snapshot_before, snapshot_after) or {}).items()},
    }, from_tier_stats(snapshot_before.tiers, snapshot_after.tiers)


def _peer_throughput_results(
    raw: dict[str, Any], requests: list[BenchRequest], tokenizer: TokenizerLike
) -> dict[str, Any]:
    elapsed = raw["elapsed_s"]
    prompt_tokens = sum(len(r.token_ids(tokenizer)) for r in requests)
    output_tokens = sum(r.max_tokens for r in requests)  # the peers generate exactly max_tokens (EOS ignored)
    return {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
    }


def _peer_job(peer: PeerSpec, model: str, mode: str, requests: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"gguf": str(gguf_path(model)), "threads": peer.threads, "mode": mode, "batch_size": peer.batch_size,
            "dtype": peer.dtype, "requests": requests, **extra}  # fmt: skip


def _result(kind: str, model: str, engine_args: dict[str, Any], workload: dict[str, Any], run: dict[str, Any],
            backends: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    result = {"kind": kind, "system": system_info(include_jax_devices=True), "model": model,
              "dtype": engine_args.get("dtype"), "config": engine_args, "workload": workload, "run": run,
              "backends": backends}  # fmt: skip
    return with_ratios(result)


def run_throughput(
    model: str,
    engine_args: dict[str, Any],
    make_workload: Callable[[TokenizerLike, set[int]], Workload],
    peer: PeerSpec | None = None,
    ignore_eos: bool = True,
    show_progress: bool = True,
) -> dict[str, Any]:
    """jaxserve's offline throughput on a workload, then the peer's on the same token ids."""
    llm = _jaxserve_llm(model, engine_args)
    tokenizer = llm.get_tokenizer()
    workload = make_workload(tokenizer, special_token_ids(tokenizer))
    requests = workload.requests
    ours, tiers = measure_throughput(llm, requests, ignore_eos, show_progress)
    info = {"warm_up_s": llm.warm_up_seconds, "num_compilations": llm.engine.num_compilations,
            "engine_config": dataclasses.asdict(llm.engine.config)}  # fmt: skip
    backends: dict[str, Any] = {OURS: {"results": ours, "kv_tiers": tiers, "info": info}}
    llm.close()
    del llm
    gc.collect()
    if peer is not None:
        jobs = [{"prompt_token_ids": r.token_ids(tokenizer), "max_tokens": r.max_tokens} for r in requests]
        job = _peer_job(peer, model, "throughput", jobs)
        raw = run_offline_peer(peer.name, job, peer.python)
        backends[peer.name] = {"results": _peer_throughput_results(raw, requests, tokenizer), "info": raw}
    return _result("throughput", model, engine_args, workload.describe(), {"ignore_eos": ignore_eos}, backends)


def latency_summary(prefill_s: list[float], latency_s: list[float], output_len: int) -> dict[str, Any]:
    prefill, full = np.asarray(prefill_s), np.asarray(latency_s)
    decode = (full - prefill) / max(output_len - 1, 1)
    return {
        "iterations": len(full),
        "mean_prefill_ms": float(prefill.mean() * 1e3),
        "median_prefill_ms": float(np.median(prefill) * 1e3),
        "mean_latency_ms": float(full.mean() * 1e3),
        "median_latency_ms": float(np.median(full) * 1e3),
        "p90_latency_ms": float(np.percentile(full, 90) * 1e3),
        "mean_decode_ms_per_token": float(decode.mean() * 1e3),
        "decode_tokens_per_s": float(1.0 / decode.mean()) if decode.mean() > 0 else None,
        "end_to_end_tokens_per_s": float(output_len / full.mean()),
    }


def _latency_prompts(sampler: TokenSampler, input_len: int, iterations: int) -> list[list[int]]:
    """Two fresh prompts per iteration: one for the prefill-only run, one for the full run."""
    return [sampler.ids(input_len) for _ in range(2 * iterations)]


def run_latency(model: str, engine_args: dict[str, Any], input_len: int, output_len: int, iters: int,
                warmup_iters: int = 1, seed: int = 0, peer: PeerSpec | None = None) -> dict[str, Any]:  # fmt: skip
    """Prefill and per-token decode time of a single request, for jaxserve and then the peer."""
    from jaxserve import SamplingParams

    if output_len < 2:
        raise ValueError("output_len must be at least 2 to measure decoding")
    llm = _jaxserve_llm(model, engine_args)
    tokenizer = llm.get_tokenizer()
    prompts = _latency_prompts(
        TokenSampler(tokenizer, seed, special_token_ids(tokenizer)), input_len, warmup_iters + iters
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prefill_s, latency_s = [], []
    tiers_before = llm.engine.snapshot().tiers
    for i in range(warmup_iters + iters):
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompts[2 * i]}, one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompts[2 * i + 1]}, full, use_tqdm=False)
        t2 = time.perf_counter()
        if i >= warmup_iters:
            prefill_s.append(t1 - t0)
            latency_s.append(t2 - t1)
    info = {"warm_up_s": llm.warm_up_seconds, "prefill_s": prefill_s, "latency_s": latency_s,
            "num_compilations": llm.engine.num_compilations}  # fmt: skip
    backends: dict[str, Any] = {
        OURS: {
            "results": latency_summary(prefill_s, latency_s, output_len),
            "info": info,
            "kv_tiers": from_tier_stats(tiers_before, llm.engine.snapshot().tiers),
        }
    }
    llm.close()
    del llm
    gc.collect()
    if peer is not None:
        requests = [{"prompt_token_ids": p, "max_tokens": output_len} for p in prompts]
        job = _peer_job(peer, model, "latency", requests, iters=iters, warmup_iters=warmup_iters)
        raw = run_offline_peer(peer.name, job, peer.python)
        backends[peer.name] = {"results": latency_summary(raw["prefill_s"], raw["latency_s"], output_len), "info": raw}
    workload = {"name": "latency", "params": {"input_len": input_len, "output_len": output_len, "seed": seed}}
    run = {"iters": iters, "warmup_iters": warmup_iters}
    return _result("latency", model, engine_args, workload, run, backends)
