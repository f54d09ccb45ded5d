"""A worker SIGKILLed under streamed chats through `jaxserve router`: how many streams end badly.

Starts two `jaxserve worker` processes (tiny random model by default) and a router over them on
loopback, sends `--requests` streamed chat completions at `--concurrency`, and once `--kill-after`
of them have finished, SIGKILLs the worker running the most streams. Prints JSON: the streams in
flight on that worker at the kill, and how many streams ended with an error event, without
`[DONE]`, or with fewer tokens than asked (every request ignores EOS).

    python -m bench.failover --requests 4000 --concurrency 48 --kill-after 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import aiohttp

WORKER_FLAGS = [
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "256",
    "--max-model-len",
    "256",
    "--block-size",
    "8",
    "--num-blocks",
    "1024",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], ready: str, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if ready in line:  # read the rest on a thread, so that a full pipe never blocks the child
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{argv[0]} did not print {ready!r}")


async def _chat(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny-random",
        "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = {"error": False, "done": False, "tokens": 0}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            result["error"] = True
            return result
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                result["done"] = True
                continue
            event = json.loads(payload)
            if "error" in event:
                result["error"] = True
            if event.get("usage"):
                result["tokens"] = event["usage"]["completion_tokens"]
    return result


async def _load(url: str, args: argparse.Namespace, kill: Any) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    next_index = 0
    killed = False

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index, killed
        while next_index < args.requests:
            i = next_index
            next_index += 1
            try:
                results.append(await _chat(session, url, i, args.max_tokens))
            except aiohttp.ClientError:
                results.append({"error": True, "done": False, "tokens": 0})
            if not killed and len(results) >= args.kill_after:
                killed = True
                await kill(session)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--kill-after", type=int, default=150, help="finished requests before the kill")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="tiny-random")
    args = p.parse_args()
    ports = [_free_port(), _free_port()]
    workers = [
        _start(["worker", "--model", args.model, "--port", str(port), *WORKER_FLAGS], "worker listening", 900)
        for port in ports
    ]
    router_port = _free_port()
    router = _start(
        [
            "router",
            "--port",
            str(router_port),
            "--health-check-interval",
            "0.5",
            *[a for port in ports for a in ("--worker", f"127.0.0.1:{port}")],
        ],
        "Running on",
        300,
    )
    url = f"http://127.0.0.1:{router_port}"
    at_kill: dict[str, Any] = {}

    async def kill(session: aiohttp.ClientSession) -> None:
        async with session.get(url + "/health") as resp:
            health = await resp.json()
        in_flight = [w["in_flight"] for w in health["workers"]]
        victim = max(range(len(in_flight)), key=in_flight.__getitem__)
        workers[victim].send_signal(signal.SIGKILL)
        at_kill.update(victim=victim, in_flight=in_flight)

    try:
        results = asyncio.run(_load(url, args, kill))
    finally:
        for proc in [router, *workers]:
            proc.kill()
            proc.wait()
    report = {
        "requests": len(results),
        "concurrency": args.concurrency,
        "in_flight_at_kill": at_kill.get("in_flight"),
        "ended_with_error": sum(r["error"] for r in results),
        "without_done": sum(not r["done"] for r in results),
        "short": sum(r["tokens"] != args.max_tokens and not r["error"] for r in results),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
