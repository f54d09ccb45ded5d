"""`jaxserve bench serve`: load a server with a workload and measure it on the client.

The target is a running server (`--base-url`) or a `jaxserve serve` this command starts itself on
a free loopback port and stops afterwards. With `--peer llama-cpp` (llama-cpp-python's OpenAI
server, one request at a time), `--peer llama-server` (llama.cpp's own server, continuous
batching over `--peer-slots` slots) or `--peer vllm` (vLLM's OpenAI server, on a Hugging Face
directory converted from the same GGUF), the peer is then started and sent the same requests on
the same arrival schedule; the two never run at the same time (one shared CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import spec_report
from bench.http_client import Endpoint
from bench.kv_tier_report import from_server_counters
from bench.load import LoadSpec, run_load
from bench.metrics import SLO, RequestRecord, compute_metrics, latency_lists, metrics_by_group
from bench.model_files import gguf_path
from bench.peers.runner import PeerUnavailable, check_peer, run_offline_peer
from bench.plots import plot_cdfs, plot_latency_curves
from bench.report import OURS, with_ratios
from bench.server_process import (
    ManagedServer,
    free_port,
    jaxserve_argv,
    llama_server_argv,
    llamacpp_argv,
    vllm_argv,
    vllm_env,
)
from bench.system_info import system_info
from bench.workloads import TokenizerLike, Workload

SERVE_PEERS = ("llama-cpp", "llama-server", "vllm")


@dataclasses.dataclass
class ServeOptions:
    model: str
    base_url: str | None = None  # a running jaxserve server; None: start one
    served_model_name: str | None = None  # the `model` field sent (default: the spec's file name)
    server_args: list[str] = dataclasses.field(default_factory=list)  # extra `jaxserve serve` flags
    startup_timeout_s: float = 900.0
    api_key: str | None = None
    ignore_eos: bool = True  # every request generates exactly max_tokens (fair token counts)
    peer: str | None = None
    peer_python: str | None = None
    peer_threads: int = 2
    peer_n_ctx: int = 4096  # per slot for llama-server; vllm: its --max-model-len
    peer_binary: str = "llama-server"  # llama-server: the executable (a path, or a name on PATH)
    peer_slots: int = 32  # llama-server: parallel slots
    peer_model: str | None = None  # vllm: a Hugging Face directory (default: converted from the GGUF, cached)
    peer_convert_python: str | None = None  # vllm: the interpreter that converts the GGUF (default: peer_python)
    peer_dtype: str = "bfloat16"  # vllm: its --dtype
    peer_kv_cache_gib: float = 2.0  # vllm: VLLM_CPU_KVCACHE_SPACE


@dataclasses.dataclass
class RunResult:
    """One workload run against one endpoint."""

    records: list[RequestRecord]
    duration_s: float
    metrics: dict[str, Any]
    groups: dict[str, Any]
    server_counters: dict[str, float] | None
    kv_tiers: dict[str, Any] | None = None  # the server's per-tier KV counters over the run
    speculative: dict[str, Any] | None = None  # the server's speculative decoding counters over the run

    def to_json(self, detailed: bool = False) -> dict[str, Any]:
        requests = [
            {"group": r.group, "success": r.success, "error": r.error or None, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens, "ttft_s": r.ttft, "tpot_s": r.tpot,
             "e2el_s": r.e2el, **({"itl_s": r.itl} if detailed else {})}
            for r in self.records
        ]  # fmt: skip
        return {"results": self.metrics, "groups": self.groups, "server_counters_delta": self.server_counters,
                "kv_tiers": self.kv_tiers, "speculative": self.speculative, "requests": requests}  # fmt: skip

    @property
    def latency_lists(self) -> dict[str, list[float]]:
        return latency_lists(self.records)


def scrape_counters(base_url: str) -> dict[str, float] | None:
    """Every counter sample of a Prometheus `/metrics` page, or None when the server has none."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
            text = response.read().decode("utf-8")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
    return parse_counters(text)


def parse_counters(text: str) -> dict[str, float]:
    """Every counter sample of a Prometheus text page, named `name_total{label=value,...}`, and
    each histogram's `name_count` and `name_sum` (counters too)."""
    counters = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "histogram"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_total", "_count", "_sum")):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                counters[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return counters


def measure(endpoint: Endpoint, workload: Workload, spec: LoadSpec, tokenizer: TokenizerLike, slo: SLO | None,
            percentiles: tuple[float, ...], label: str = "", show_progress: bool = True) -> RunResult:  # fmt: skip
    before = scrape_counters(endpoint.base_url)
    records, duration = asyncio.run(run_load(endpoint, workload, spec, tokenizer, show_progress, label))
    after = scrape_counters(endpoint.base_url)
    counters = tiers = speculative = None
    if before is not None and after is not None:
        counters = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        tiers = from_server_counters(before, after)
        speculative = spec_report.from_server_counters(before, after)
    return RunResult(records, duration, compute_metrics(records, duration, slo, percentiles),
                     metrics_by_group(records, duration, slo, percentiles), counters, tiers, speculative)  # fmt: skip


def served_model_name(opts: ServeOptions) -> str:
    """The `model` field of the requests: as given, else the spec's file name (`jaxserve serve`'s default)."""
    return opts.served_model_name or Path(opts.model).name


@contextlib.contextmanager
def jaxserve_endpoint(opts: ServeOptions) -> Iterator[tuple[Endpoint, dict[str, Any]]]:
    extra = {"ignore_eos": True} if opts.ignore_eos else {}
    name = served_model_name(opts)
    if opts.base_url:
        yield Endpoint(opts.base_url.rstrip("/"), name, extra, opts.api_key), {"base_url": opts.base_url}
        return
    port = free_port()
    argv = jaxserve_argv(opts.model, port, opts.server_args)
    with ManagedServer(argv, port, "/health", opts.startup_timeout_s, name="jaxserve") as server:
        info = {"argv": argv, "startup_s": server.startup_seconds, "log": str(server.log_path)}
        yield Endpoint(server.base_url, name, extra, opts.api_key), info


@contextlib.contextmanager
def llamacpp_endpoint(opts: ServeOptions, eos_token_ids: tuple[int, ...]) -> Iterator[tuple[Endpoint, dict[str, Any]]]:
    """llama-cpp-python's OpenAI server on the model's GGUF; EOS is banned through logit_bias when
    `ignore_eos` is set (that server has no ignore_eos)."""
    versions = check_peer("llama-cpp-server", opts.peer_python)
    gguf = str(gguf_path(opts.model))
    port = free_port()
    argv = llamacpp_argv(opts.peer_python or sys.executable, gguf, port, opts.peer_threads, opts.peer_n_ctx)
    extra = {"logit_bias": {str(t): -100.0 for t in eos_token_ids}} if opts.ignore_eos else {}
    with ManagedServer(argv, port, "/v1/models", opts.startup_timeout_s, name="llama-cpp") as server:
        info = {"argv": argv, "startup_s": server.startup_seconds, "versions": versions}
        yield Endpoint(server.base_url, served_model_name(opts), extra), info


@contextlib.contextmanager
def llama_server_endpoint(opts: ServeOptions) -> Iterator[tuple[Endpoint, dict[str, Any]]]:
    """llama.cpp's `llama-server` on the model's GGUF (it takes `ignore_eos` as a request field)."""
    binary = llama_server_binary(opts)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    gguf = str(gguf_path(opts.model))
    port = free_port()
    argv = llama_server_argv(binary, gguf, port, opts.peer_threads, opts.peer_n_ctx, opts.peer_slots)
    extra = {"ignore_eos": True} if opts.ignore_eos else {}
    with ManagedServer(argv, port, "/health", opts.startup_timeout_s, name="llama-server") as server:
        info = {"argv": argv, "startup_s": server.startup_seconds, "versions": {"llama-server": " ".join(version)}}
        yield Endpoint(server.base_url, served_model_name(opts), extra), info


@contextlib.contextmanager
def vllm_endpoint(opts: ServeOptions) -> Iterator[tuple[Endpoint, dict[str, Any]]]:
    """vLLM's OpenAI server (its CPU build on a CPU) on a Hugging Face directory of the same weights
    (`ignore_eos` is a request field there)."""
    versions = check_peer("vllm", opts.peer_python)
    python = opts.peer_python or sys.executable
    model_dir = vllm_model_dir(opts)
    port = free_port()
    argv = vllm_argv(python, str(model_dir), served_model_name(opts), port, opts.peer_dtype, opts.peer_n_ctx)
    env = vllm_env(python, opts.peer_threads, opts.peer_kv_cache_gib)
    extra = {"ignore_eos": True} if opts.ignore_eos else {}
    with ManagedServer(argv, port, "/health", opts.startup_timeout_s, env=env, name="vllm") as server:
        info = {
            "argv": argv,
            "env": env,
            "startup_s": server.startup_seconds,
            "versions": versions,
            "log": str(server.log_path),
        }
        yield Endpoint(server.base_url, served_model_name(opts), extra), info


def vllm_model_dir(opts: ServeOptions) -> Path:
    """`--peer-model`, else the model's GGUF converted to a Hugging Face directory by transformers
    (bench/peers/gguf_to_hf.py, in `--peer-convert-python`), once: cached next to jaxserve's
    checkpoints and reused while the GGUF is unchanged."""
    from checkpoints.registry import cache_dir

    if opts.peer_model:
        path = Path(opts.peer_model).expanduser()
        if not (path / "config.json").is_file():
            raise PeerUnavailable(f"--peer-model {path} is not a Hugging Face model directory (no config.json)")
        return path
    try:
        gguf = gguf_path(opts.model)
    except ValueError as e:
        raise PeerUnavailable(f"{e}; give vllm a Hugging Face directory with --peer-model DIR") from e
    stat = gguf.stat()
    path = cache_dir() / "hf-from-gguf" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (path / "config.json").is_file():
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    run_offline_peer(
        "gguf-to-hf", {"gguf": str(gguf), "out_dir": str(partial)}, opts.peer_convert_python or opts.peer_python
    )
    partial.rename(path)
    return path


def llama_server_binary(opts: ServeOptions) -> str:
    binary = shutil.which(opts.peer_binary)
    if binary is None:
        raise PeerUnavailable(
            f"peer 'llama-server' needs llama.cpp's llama-server executable ({opts.peer_binary!r} not found): build "
            "it from llama.cpp (cmake --build build --target llama-server) and pass --peer-binary PATH"
        )
    return binary


def check_serving_peer(opts: ServeOptions) -> None:
    """Fail before jaxserve's run, not after it, when the asked-for peer cannot run."""
    if opts.peer is None:
        return
    if opts.peer not in SERVE_PEERS:
        raise ValueError(f"unknown serving peer {opts.peer!r}; choose from {SERVE_PEERS}")
    if opts.peer == "llama-server":
        llama_server_binary(opts)
    elif opts.peer == "vllm":
        check_peer("vllm", opts.peer_python)
        vllm_model_dir(opts)  # converts the GGUF now (once), not after jaxserve's run
        return
    else:
        check_peer("llama-cpp-server", opts.peer_python)
    try:
        gguf_path(opts.model)
    except ValueError as e:
        raise PeerUnavailable(str(e)) from e


def endpoint_for(backend: str, opts: ServeOptions, tokenizer: Any):
    if backend == OURS:
        return jaxserve_endpoint(opts)
    if backend == "llama-cpp":
        return llamacpp_endpoint(opts, tuple(tokenizer.eos_token_ids))
    if backend == "llama-server":
        return llama_server_endpoint(opts)
    if backend == "vllm":
        return vllm_endpoint(opts)
    raise ValueError(f"unknown serving peer {backend!r}; choose from {SERVE_PEERS}")


def server_dtype(server_args: list[str]) -> str:
    """The weights' dtype a `jaxserve serve` with these arguments runs: its --dtype, where `auto`
    (the command line's default) is what the server will pick on this machine."""
    import argparse

    from jaxserve.dtype_choice import AUTO, choose_dtype
    from jaxserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_known_args(server_args)[0])
    return choose_dtype(config)[0] if config.dtype == AUTO else config.dtype


def curve_x(spec: LoadSpec, metrics: dict[str, Any]) -> float:
    """Where a run sits on a latency-vs-rate plot: its offered rate, or the achieved one if unpaced."""
    return spec.request_rate if spec.request_rate != float("inf") else metrics["request_throughput"]


def run_serve(opts: ServeOptions, workload: Workload, spec: LoadSpec, tokenizer: Any, slo: SLO | None,
              percentiles: tuple[float, ...], detailed: bool = False, plot_stem: str | None = None,
              show_progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """jaxserve, then the peer if any, on the same workload and schedule; returns the result JSON."""
    check_serving_peer(opts)
    backends: dict[str, Any] = {}
    runs: dict[str, RunResult] = {}
    for backend in [OURS, *([opts.peer] if opts.peer else [])]:
        with endpoint_for(backend, opts, tokenizer) as (endpoint, info):
            runs[backend] = measure(endpoint, workload, spec, tokenizer, slo, percentiles, backend, show_progress)
        backends[backend] = {**runs[backend].to_json(detailed), "info": info}
    result = {
        "kind": "serve",
        "system": system_info(include_jax_devices=opts.base_url is None),
        "model": opts.model,
        "dtype": server_dtype(opts.server_args),
        "config": {"server_args": opts.server_args, "base_url": opts.base_url, "peer_threads": opts.peer_threads},
        "workload": workload.describe(),
        "run": {**spec.describe(), "slo": dataclasses.asdict(slo) if slo else None, "ignore_eos": opts.ignore_eos},
        "backends": backends,
    }
    with_ratios(result)
    if plot_stem:
        title = f"{opts.model}, {workload.name}"
        cdf = plot_cdfs({b: r.latency_lists for b, r in runs.items()}, f"{plot_stem}-cdf.png", title)
        curves = {b: [(curve_x(spec, r.metrics), r.metrics)] for b, r in runs.items()}
        latency = plot_latency_curves(curves, f"{plot_stem}-latency.png", "request rate (req/s)", title)
        result["plots"] = [str(cdf), str(latency)]
    return result
