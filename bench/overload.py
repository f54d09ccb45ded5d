"""Admission under overload: offer a server k times the load it can serve, and see what happens.

First a closed loop of `--concurrency` clients measures the server's capacity (completed requests
per second at saturation: give more clients than --max-num-seqs, so that a full batch always runs,
and no more than --max-num-seqs + --max-waiting-seqs). Then, for each factor (2x and 4x by
default), requests arrive as a Poisson process at factor x capacity for `--duration` seconds.
Every request gets one answer: served (its latency counts), refused with 503 (its Retry-After and
error code are kept), or lost (no answer, a connection error or another status: a server bug).
The server is meant to run with a queue deadline, e.g.

    jaxserve serve --model tiny-random --max-num-seqs 8 --max-waiting-seqs 32 --max-queue-wait 1 --port 8000
    python -m bench.overload --base-url http://127.0.0.1:8000 --concurrency 16

(a router behind its workers works the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from typing import Any

import aiohttp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (connection error, client timeout)
    latency: float  # seconds from sending to the whole answer
    code: str | None = None  # the error's code (503: server_overloaded or queue_timeout)
    retry_after: str | None = None
    completion_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Workload:
    base_url: str
    model: str
    api_key: str | None = None
    max_tokens: int = 32
    n: int = 1
    prompt: str = "Tell me a long story about queues."
    timeout: float = 120.0

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "n": self.n,
                "temperature": 0, "ignore_eos": True}  # fmt: skip

    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}


async def send_one(http: aiohttp.ClientSession, work: Workload, body: dict[str, Any] | None = None) -> Answer:
    start = time.perf_counter()
    try:
        async with http.post(f"{work.base_url}/v1/completions", json=body or work.body()) as resp:
            payload = await resp.json(content_type=None)
            latency = time.perf_counter() - start
            if resp.status == 200:
                return Answer(200, latency, completion_tokens=payload["usage"]["completion_tokens"])
            code = payload.get("error", {}).get("code") if isinstance(payload, dict) else None
            return Answer(resp.status, latency, code, resp.headers.get("Retry-After"))
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
        return Answer(0, time.perf_counter() - start)


def _session(work: Workload) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        headers=work.headers(),
        timeout=aiohttp.ClientTimeout(total=work.timeout),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def measure_capacity(work: Workload, concurrency: int, duration: float) -> float:
    """Completed requests per second with `concurrency` clients sending back to back (one refused
    by the queue deadline tries again a moment later)."""
    deadline = time.perf_counter() + duration
    done = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            answer = await send_one(http, work)
            if answer.status == 503:  # queued past the deadline: the server is full, which is the point
                await asyncio.sleep(0.05)
            elif answer.status != 200:
                raise RuntimeError(f"capacity run: a request got {answer.status} ({answer.code})")
            else:
                done += 1

    start = time.perf_counter()
    async with _session(work) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


async def offer(work: Workload, rate: float, duration: float, seed: int = 0) -> list[Answer]:
    """Requests at the times of a Poisson process of `rate` per second over `duration` seconds."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, size=max(1, int(rate * duration * 2))))
    times = times[times < duration]
    start = time.perf_counter()

    async def at(http: aiohttp.ClientSession, t: float) -> Answer:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        return await send_one(http, work)

    async with _session(work) as http:
        return list(await asyncio.gather(*(at(http, float(t)) for t in times)))


def summarize(answers: list[Answer]) -> dict[str, Any]:
    """p50/p99 latency of served requests, the fraction refused (503), refusals by code, and lost ones."""
    served = sorted(a.latency for a in answers if a.status == 200)
    refused = [a for a in answers if a.status == 503]
    codes: dict[str, int] = {}
    for a in refused:
        codes[str(a.code)] = codes.get(str(a.code), 0) + 1
    return {
        "requests": len(answers),
        "served": len(served),
        "refused_fraction": len(refused) / len(answers) if answers else 0.0,
        "refused_by_code": codes,
        "lost": sum(a.status not in (200, 503) for a in answers),
        "served_p50_s": float(np.percentile(served, 50)) if served else None,
        "served_p99_s": float(np.percentile(served, 99)) if served else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, required=True, help="clients of the capacity run (> --max-num-seqs)")
    p.add_argument("--factors", type=float, nargs="+", default=[2.0, 4.0], help="offered load / capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each run")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    model = args.model or asyncio.run(_first_model(args.base_url, args.api_key))
    work = Workload(args.base_url, model, args.api_key, args.max_tokens)
    capacity = asyncio.run(measure_capacity(work, args.concurrency, args.duration))
    report: dict[str, Any] = {"capacity_rps": capacity, "runs": {}}
    for factor in args.factors:
        answers = asyncio.run(offer(work, factor * capacity, args.duration))
        report["runs"][f"{factor:g}x"] = summarize(answers)
    print(json.dumps(report, indent=2))
    return 0


async def _first_model(base_url: str, api_key: str | None) -> str:
    async with aiohttp.ClientSession(headers=Workload(base_url, "", api_key).headers()) as http:
        async with http.get(f"{base_url}/v1/models") as resp:
            return (await resp.json())["data"][0]["id"]


if __name__ == "__main__":
    raise SystemExit(main())
