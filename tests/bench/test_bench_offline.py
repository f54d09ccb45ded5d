"""`bench throughput` / `bench latency` on the tiny-random engine, and the peers' missing-dependency path."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bench_engine_args import SMALL_ENGINE

from bench.offline import run_latency, run_throughput
from bench.peers.runner import PeerUnavailable, check_peer, run_offline_peer
from bench.workloads import TokenSampler, random_workload


def test_throughput_counts_every_token_and_compiles_nothing_new(compile_cache):
    def make(tokenizer, special):
        return random_workload(TokenSampler(tokenizer, 0, special), 6, input_len=20, output_len=5)

    result = run_throughput(
        "tiny-random", {**SMALL_ENGINE, "compilation_cache_dir": compile_cache}, make, show_progress=False
    )
    assert result["kind"] == "throughput" and result["workload"]["total_prompt_tokens"] == 120
    ours = result["backends"]["jaxserve"]["results"]
    assert ours["num_requests"] == 6 and ours["total_prompt_tokens"] == 120 and ours["total_output_tokens"] == 30
    assert ours["output_tokens_per_s"] == pytest.approx(30 / ours["elapsed_s"])
    assert ours["prompt_tokens_computed"] == 120 - ours["cached_prompt_tokens"]
    assert ours["compilations_during_run"] == 0
    assert result["system"]["accelerator"]
    tiers = result["backends"]["jaxserve"]["kv_tiers"]
    assert (
        tiers["device_hit_tokens"] + tiers["host_hit_tokens"] + tiers["disk_hit_tokens"] == ours["cached_prompt_tokens"]
    )
    assert tiers["disk_loads"] == 0 and tiers["disk_bytes_written"] == 0  # no disk tier here


@pytest.mark.slow  # ~65 s; the draft model is tested in test_speculative_draft_model, the report in the test above
def test_throughput_reports_speculative_decoding_with_a_draft_model(compile_cache):
    """The target as its own draft: nearly every draft is accepted, and the report says so per position."""

    def make(tokenizer, special):
        return random_workload(TokenSampler(tokenizer, 0, special), 2, input_len=20, output_len=12)

    spec = {"model": "tiny-random", "num_speculative_tokens": 2, "adaptive_draft_length": False}
    engine = {**SMALL_ENGINE, "compilation_cache_dir": compile_cache, "speculative_config": spec}
    ours = run_throughput("tiny-random", engine, make, show_progress=False)["backends"]["jaxserve"]["results"]
    assert ours["spec_drafts"] > 0 and ours["spec_draft_tokens"] <= 2 * ours["spec_drafts"]
    assert ours["spec_acceptance_rate"] > 0.9 and ours["spec_acceptance_rate_position_1"] > 0.9
    assert ours["spec_mean_accepted_tokens"] == ours["spec_accepted_tokens"] / ours["spec_drafts"]
    assert ours["spec_draft_seconds"] > 0 and ours["compilations_during_run"] == 0
    assert ours["spec_mean_draft_length"] == 2  # pinned: k = 2 at every decode step


def test_latency_reports_prefill_and_decode(compile_cache):
    # 31 decode steps after the first token, so the full run outlasts the one-token run by far more than
    # the noise of a loaded CI machine (with 5 steps, one stalled prefill once outlasted a full run).
    result = run_latency(
        "tiny-random",
        {**SMALL_ENGINE, "compilation_cache_dir": compile_cache},
        input_len=16,
        output_len=32,
        iters=2,
        warmup_iters=1,
    )
    ours = result["backends"]["jaxserve"]["results"]
    assert ours["iterations"] == 2
    assert 0 < ours["mean_prefill_ms"] < ours["mean_latency_ms"]
    assert ours["mean_decode_ms_per_token"] > 0
    assert len(result["backends"]["jaxserve"]["info"]["latency_s"]) == 2


def test_missing_peer_is_a_clear_error():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("llama-cpp-python is installed in this interpreter")
    with pytest.raises(PeerUnavailable, match="pip install"):
        check_peer("llama-cpp", sys.executable)
    job = {
        "gguf": "unused.gguf",
        "threads": 1,
        "mode": "throughput",
        "batch_size": 1,
        "requests": [{"prompt_token_ids": [1], "max_tokens": 1}],
    }
    with pytest.raises(PeerUnavailable, match="llama-cpp-python"):
        run_offline_peer("llama-cpp", job, sys.executable)


def test_cli_refuses_a_peer_it_cannot_run_before_running_anything():
    for command in (
        ["throughput", "--peer", "transformers", "--peer-python", sys.executable],
        ["serve", "--peer", "llama-cpp", "--peer-python", sys.executable],
        ["sweep", "--concurrencies", "1", "--peer", "llama-server", "--peer-binary", "/nonexistent/llama-server"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "jaxserve.cli", "bench", *command, "--model", "tiny-random"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert "jaxserve bench:" in done.stderr and "Traceback" not in done.stderr
        assert command[command.index("--peer") + 1] in done.stderr  # says which peer is missing
