"""`jaxserve bench serve` end to end against real `jaxserve serve --model tiny-random` servers.

Small buckets keep the server's warm-up short; the servers share one persistent compilation cache
(conftest.py), so only the first one compiles.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_engine_args import SMALL_ENGINE, engine_flags

from bench.server_process import ManagedServer, free_port, jaxserve_argv
from jaxserve.config import EngineConfig
from jaxserve.dtype_choice import choose_dtype

ENGINE_ARGS = engine_flags(SMALL_ENGINE)
pytestmark = pytest.mark.slow
TIMEOUT_S = 600
STATS = ("mean", "median", "p90", "p99")


def bench(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--model", "tiny-random", "--no-progress", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_bench_serve_starts_a_server_and_writes_json_and_png(tmp_path, compile_cache):
    result_file = tmp_path / "serve.json"
    server_args = " ".join([*ENGINE_ARGS, "--compilation-cache-dir", compile_cache])
    done = bench("--server-args", server_args, "--num-prompts", "16", "--input-len", "16", "--output-len", "8",
                 "--request-rate", "40", "--slo", "2000,500", "--plot", "--result-file", str(result_file))  # fmt: skip
    assert "request_throughput" in done.stdout  # the table
    result = json.loads(result_file.read_text())
    # No --dtype: the server's `auto`, as it resolves on this machine (bfloat16 with AVX512-BF16).
    auto_dtype = choose_dtype(EngineConfig())[0]
    assert result["kind"] == "serve" and result["model"] == "tiny-random" and result["dtype"] == auto_dtype
    assert result["system"]["cpu_count"] >= 1 and result["system"]["versions"]["jax"]
    assert result["workload"]["name"] == "random" and result["run"]["request_rate"] == 40.0
    ours = result["backends"]["jaxserve"]
    assert ours["info"]["startup_s"] > 0
    metrics = ours["results"]
    assert metrics["completed"] == 16 and metrics["failed"] == 0
    assert metrics["total_output_tokens"] == 16 * 8  # ignore_eos: exactly max_tokens each
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in STATS:
            assert metrics[f"{stat}_{name}_ms"] is not None, f"{stat}_{name}_ms"
    assert metrics["median_ttft_ms"] <= metrics["median_e2el_ms"]
    assert metrics["request_throughput"] > 0 and metrics["output_throughput"] > 0
    assert 0 <= metrics["request_goodput"] <= metrics["request_throughput"]
    assert len(ours["requests"]) == 16
    assert ours["server_counters_delta"]["jaxserve_generation_tokens_total"] == 16 * 8
    assert len(result["plots"]) == 2
    for png in result["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def running_server(compile_cache):
    port = free_port()
    argv = jaxserve_argv("tiny-random", port, [*ENGINE_ARGS, "--compilation-cache-dir", compile_cache])
    with ManagedServer(argv, port, startup_timeout_s=TIMEOUT_S, name="jaxserve-test") as server:
        yield server.base_url


def test_multi_turn_through_sessions_reuses_the_history(tmp_path, running_server):
    result_file = tmp_path / "mt.json"
    bench("--base-url", running_server, "--workload", "multi-turn", "--multi-turn-api", "sessions",
          "--num-sessions", "3", "--turns", "3", "--user-len", "8", "--output-len", "6", "--max-concurrency", "2",
          "--result-file", str(result_file))  # fmt: skip
    ours = json.loads(result_file.read_text())["backends"]["jaxserve"]
    assert ours["results"]["completed"] == 9 and ours["results"]["failed"] == 0
    later = ours["groups"]["turn-2+"]
    assert later["completed"] == 6
    assert later["total_cached_prompt_tokens"] > 0  # each later turn found its history in the prefix cache


def test_shared_prefix_hits_the_prefix_cache(tmp_path, running_server):
    result_file = tmp_path / "sp.json"
    done = bench("--base-url", running_server, "--workload", "shared-prefix", "--prompt-format", "ids",
          "--num-prefixes", "2", "--prefix-len", "48", "--suffix-len", "8", "--num-prompts", "8",
          "--output-len", "4", "--max-concurrency", "2", "--seed", "11", "--result-file", str(result_file))  # fmt: skip
    ours = json.loads(result_file.read_text())["backends"]["jaxserve"]
    metrics = ours["results"]
    assert metrics["completed"] == 8
    # 8 prompts over 2 prefixes of 3 full blocks, 2 in flight: only the first request of a prefix and
    # one sent alongside it can miss, so at least 4 prompts reuse all 48 prefix tokens
    assert metrics["total_cached_prompt_tokens"] >= 4 * 48
    assert metrics["prefill_tokens_computed"] == metrics["total_input_tokens"] - metrics["total_cached_prompt_tokens"]
    # the server's per-tier counters over the run: every cached token came from one tier (no disk tier here)
    tiers = ours["kv_tiers"]
    assert tiers["device_hit_tokens"] + tiers["host_hit_tokens"] == metrics["total_cached_prompt_tokens"]
    assert tiers["disk_hit_tokens"] == tiers["disk_bytes_read"] == 0
    assert "jaxserve, KV tiers" in done.stdout
