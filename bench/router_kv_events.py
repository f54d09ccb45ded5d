"""Prefix-cache hit rate of a multi-turn workload over several workers behind several routers, with
the routers following the workers' KV events against placing by their own picture of what they sent
(`--no-kv-events`), same workers, same run.

    python3 -m bench.router_kv_events [--model tiny-random] [--workers 4] [--routers 2]
        [--conversations 16] [--turns 4] [--turn-tokens 48]

Each turn of a conversation is its previous prompt plus `--turn-tokens` new tokens, sent through
the next router in turn (as clients behind a load balancer reach a different router each time), so
a router sees only some of a conversation's turns. Reported: cached prompt tokens over prompt
tokens (the workers' `usage.prompt_tokens_details.cached_tokens`), per mode. Each mode has its own
conversations (other tokens), so neither finds the other's prefixes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.server_process import ManagedServer, free_port

WORKER_FLAGS = ["--max-num-seqs", "8", "--max-model-len", "512", "--block-size", "8", "--num-blocks", "480"]


def start_worker(model: str, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "jaxserve.cli", "worker", "--model", model, "--port", str(port), *WORKER_FLAGS]
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_listening(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    for proc, log in zip(procs, logs):
        while "worker listening" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"worker did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)


def complete(base_url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["usage"]


def run_mode(routers: list[ManagedServer], args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    history = [[] for _ in range(args.conversations)]
    cached = total = 0
    with ThreadPoolExecutor(8) as pool:
        for turn in range(args.turns):
            prompts = [h + rng.integers(3, 250, args.turn_tokens).tolist() for h in history]
            urls = [routers[(c + turn) % len(routers)].base_url for c in range(args.conversations)]
            for usage in pool.map(complete, urls, [args.model] * len(urls), prompts):
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                total += usage["prompt_tokens"]
            history = prompts
            time.sleep(0.5)  # the turn's KV events reach the routers
    return {"cached_tokens": cached, "prompt_tokens": total, "hit_rate": cached / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=48)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-bench-events-"))
    ports = [free_port() for _ in range(args.workers)]
    logs = [tmp / f"worker{i}.log" for i in range(args.workers)]
    procs = [start_worker(args.model, p, log) for p, log in zip(ports, logs)]
    results = {}
    try:
        wait_listening(procs, logs)
        workers = [a for p in ports for a in ("--worker", f"127.0.0.1:{p}")]
        for seed, mode in enumerate(("kv-events", "no-kv-events")):
            routers = [
                ManagedServer(
                    [sys.executable, "-m", "jaxserve.cli", "router", "--port", str(port), *workers, f"--{mode}"],
                    port,
                    name=f"router-{mode}",
                )
                for port in (free_port() for _ in range(args.routers))
            ]
            for r in routers:
                r.start()
            try:
                results[mode] = run_mode(routers, args, seed)
            finally:
                for r in routers:
                    r.stop()
            print(f"{mode}: {results[mode]}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    events, guesses = results["kv-events"]["hit_rate"], results["no-kv-events"]["hit_rate"]
    print(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"prefix hit rate: {events:.1%} following KV events, {guesses:.1%} by the routers' own pictures")


if __name__ == "__main__":
    main()
