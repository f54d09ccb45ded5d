"""Time to first token of the third response of a chain (`previous_response_id`): with its history's
KV in the device cache (pinned), after a server restart (the history's KV read back from the KV disk
tier), and cold (the same conversation sent whole to a server with an empty cache).

    python3 -m bench.response_chain [--history-words 1200] [--chains 3] [--server-arg=...]

A chain: instructions, a long first input (`--history-words` words), a short second input, each
answered with `--output-tokens` greedy tokens, then a short third input, streamed; its TTFT is
from sending the request to the first `response.output_text.delta`. Three `jaxserve serve`
processes run one after the other: the first (with `--session-dir` and `--kv-disk-dir`) makes
`--chains` chains to the third turn (warm) and `--chains` more to the second turn; it stops
(SIGINT: the clean shutdown writes the prefix cache to disk); the second, on the same
directories, makes the third turn of those (after a restart); the third, with no disk tier, gets
each of those third turns' conversation as input items (cold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.embeddings import WORDS
from bench.server_process import ManagedServer, free_port, jaxserve_argv
from bench.system_info import system_info

INSTRUCTIONS = "You are a careful reader. Answer in one or two sentences."


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def _create(http: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The finished response, and for a streamed one the seconds to its first output text."""
    t0 = time.perf_counter()
    first, final = None, None
    async with http.post("/v1/responses", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"/v1/responses answered {reply.status}: {await reply.text()}")
        if not body.get("stream"):
            return await reply.json(), None
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - t0
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    return final, first


class Chains:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.common = {"instructions": INSTRUCTIONS, "max_output_tokens": args.output_tokens, "temperature": 0}

    def inputs(self, seed: int) -> list[str]:
        return [_text(self.args.history_words, seed), "Which words come up most often?", "And which come up least?"]

    async def first_two(self, http: aiohttp.ClientSession, seed: int) -> list[dict[str, Any]]:
        replies: list[dict[str, Any]] = []
        for text in self.inputs(seed)[:2]:
            previous = {"previous_response_id": replies[-1]["id"]} if replies else {}
            replies.append((await _create(http, {**self.common, **previous, "input": text}))[0])
        return replies

    async def third(self, http: aiohttp.ClientSession, seed: int, second_id: str) -> tuple[dict[str, Any], float]:
        body = {**self.common, "input": self.inputs(seed)[2], "previous_response_id": second_id, "stream": True}
        return await _create(http, body)

    async def cold_third(
        self, http: aiohttp.ClientSession, seed: int, replies: list[dict[str, Any]]
    ) -> tuple[dict[str, Any], float]:
        first, second, third = self.inputs(seed)
        items = [
            {"role": "user", "content": first},
            _as_input(replies[0]),
            {"role": "user", "content": second},
            _as_input(replies[1]),
            {"role": "user", "content": third},
        ]
        return await _create(http, {**self.common, "input": items, "store": False, "stream": True})


def _as_input(response: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "".join(
            part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
        ),
    }


def _serve(model: str, args: argparse.Namespace, extra: list[str]) -> ManagedServer:
    port = free_port()
    return ManagedServer(jaxserve_argv(model, port, [*extra, *args.server_arg]), port, name="jaxserve")


async def _run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chains = Chains(args)
    dirs = ["--session-dir", str(work / "sessions"), "--kv-disk-dir", str(work / "kv")]
    warm, restart, cold = [], [], []
    kept: dict[int, list[dict[str, Any]]] = {}
    with _serve(args.model, args, dirs) as server:
        async with aiohttp.ClientSession(server.base_url) as http:
            await chains.third(http, 1000, (await chains.first_two(http, 1000))[1]["id"])  # warm-up
            for seed in range(args.chains):
                first_two = await chains.first_two(http, seed)
                warm.append(await chains.third(http, seed, first_two[1]["id"]))
            for seed in range(100, 100 + args.chains):
                kept[seed] = await chains.first_two(http, seed)
    with _serve(args.model, args, dirs) as server:
        async with aiohttp.ClientSession(server.base_url) as http:
            for seed, first_two in kept.items():
                restart.append(await chains.third(http, seed, first_two[1]["id"]))
    with _serve(args.model, args, []) as server:
        async with aiohttp.ClientSession(server.base_url) as http:
            await _create(http, {"input": "Hello!", "max_output_tokens": 4, "store": False})  # warm-up, shares no block
            for seed, first_two in kept.items():
                cold.append(await chains.cold_third(http, seed, first_two))

    def summary(runs: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
        return {
            "ttft_s": [t for _, t in runs],
            "median_ttft_s": statistics.median(t for _, t in runs),
            "input_tokens": [r["usage"]["input_tokens"] for r, _ in runs],
            "cached_tokens": [r["usage"]["input_tokens_details"]["cached_tokens"] for r, _ in runs],
        }

    return {"warm": summary(warm), "after_restart": summary(restart), "cold": summary(cold)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--history-words", type=int, default=1200, help="words of the first input")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--chains", type=int, default=3, help="chains measured in each case (median reported)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `jaxserve serve` argument (repeatable)")
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-chain-") as work:
        cases = asyncio.run(_run(args, Path(work)))
    cold = cases["cold"]["median_ttft_s"]
    print(f"TTFT of the third response of a chain ({args.model}, median of {args.chains}):")
    for name, case in cases.items():
        tokens, cached = statistics.median(case["input_tokens"]), statistics.median(case["cached_tokens"])
        print(
            f"  {name:14s} {1000 * case['median_ttft_s']:8.1f} ms  input {tokens:.0f} tokens, {cached:.0f} cached  "
            f"(cold / this = {cold / case['median_ttft_s']:.1f}x)"
        )
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(
            json.dumps(
                {
                    "system": system_info(),
                    "model": args.model,
                    "args": vars(args) | {"result_file": str(args.result_file)},
                    "cases": cases,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
