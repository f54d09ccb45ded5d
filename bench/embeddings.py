"""Embeddings per second: `/v1/embeddings` of a `jaxserve serve` it starts, against a peer in the
same run (one after the other: the CPU is shared): for a decoder LM, Hugging Face transformers on
the same GGUF weights and the same token ids; for an encoder embedding model
(`all-minilm-l6-v2`), sentence-transformers on the same directory and the same texts.

    python3 -m bench.embeddings [--model M] [--texts 256] [--words 8-16] [--request-size 32] \\
        [--concurrency 8] [--peer-python /work/refvenv/bin/python] [--server-arg=--max-prefill-seqs=32 ...]

Each run embeds `--texts` texts of `--words` words (8-16 by default, uniformly; different in every
run so the prefix cache holds none of them); the first run of each backend warms up and is not
timed, `--runs` more are.
jaxserve's texts go as requests of `--request-size` inputs, `--concurrency` at a time; the peer
embeds batches of `--peer-batch-size`. Reported: texts per second (median run) of each, their
ratio, and the largest difference between the two backends' unit vectors (an encoder's pooling is
its own: `--pooling` is for decoder LMs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.model_files import encoder_dir, gguf_path
from bench.peers.runner import PeerUnavailable, check_peer, run_offline_peer
from bench.server_process import ManagedServer, free_port, jaxserve_argv
from bench.system_info import system_info
from checkpoints.encoders import is_encoder_spec

WORDS = (
    "river mountain quiet engine letter garden window silver morning planet story music market winter "
    "paper bridge forest signal ocean button yellow people kitchen number thunder"
).split()


def texts(count: int, seed: int, words: tuple[int, int] = (8, 16)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) + "." for _ in range(count)]


async def _embed_all(base_url: str, ids: list[list[int]], request_size: int, concurrency: int) -> tuple[float, list]:
    """Seconds to embed every text (by token ids), and the vectors in order."""
    limit = asyncio.Semaphore(concurrency)
    out: list[Any] = [None] * len(ids)

    async def one(http: aiohttp.ClientSession, start: int) -> None:
        async with limit:
            body = {"input": ids[start : start + request_size], "encoding_format": "float"}
            async with http.post("/v1/embeddings", json=body) as reply:
                data = await reply.json()
                if reply.status != 200:
                    raise RuntimeError(f"/v1/embeddings answered {reply.status}: {data}")
        for item in data["data"]:
            out[start + item["index"]] = item["embedding"]

    async with aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=3600)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, s) for s in range(0, len(ids), request_size)))
        return time.perf_counter() - t0, out


async def _tokenize(base_url: str, batch: list[str]) -> list[list[int]]:
    async with aiohttp.ClientSession(base_url) as http:
        ids = []
        for text in batch:
            async with http.post("/tokenize", json={"prompt": text}) as reply:
                ids.append((await reply.json())["tokens"])
        return ids


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument(
        "--words",
        type=lambda v: tuple(int(n) for n in v.split("-")),
        default=(8, 16),
        help="LOW-HIGH words per text, uniformly (a mixed-length workload: 2-150)",
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs of each backend (after one warm-up run)")
    p.add_argument("--request-size", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pooling", choices=("last", "mean"), default="last")
    p.add_argument("--peer-python", default=None, help="interpreter with torch and transformers (default: this one)")
    p.add_argument("--peer-batch-size", type=int, default=32)
    p.add_argument("--server-arg", action="append", default=[], help="extra `jaxserve serve` argument (repeatable)")
    p.add_argument("--result-file", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    peer_name = "sentence-transformers" if is_encoder_spec(args.model) else "transformers-embed"
    try:
        peer_versions = check_peer(peer_name, args.peer_python)
    except PeerUnavailable as e:
        print(e)
        return 2
    runs = [texts(args.texts, seed, args.words) for seed in range(args.runs + 1)]
    port = free_port()
    server_args = [
        *(() if peer_name == "sentence-transformers" else ("--embedding-pooling", args.pooling)),
        *args.server_arg,
    ]
    with ManagedServer(jaxserve_argv(args.model, port, server_args), port, name="jaxserve") as server:
        ids = [asyncio.run(_tokenize(server.base_url, batch)) for batch in runs]
        timed = [asyncio.run(_embed_all(server.base_url, run, args.request_size, args.concurrency)) for run in ids]
    peer = run_offline_peer(peer_name, _peer_job(args, peer_name, runs, ids), args.peer_python)
    result = _result(args, server_args, peer_versions, ids, timed, peer)
    pooling = "the model's" if peer_name == "sentence-transformers" else args.pooling
    result |= {"peer": peer_name, "pooling": pooling}
    print(
        f"{args.texts} texts of {args.words[0]}-{args.words[1]} words, "
        f"{result['mean_tokens_per_text']:.1f} tokens on average, {pooling} pooling, "
        f"median of {args.runs} runs:\n"
        f"  jaxserve      {result['jaxserve_texts_per_s']:8.1f} texts/s  (requests of {args.request_size}, "
        f"{args.concurrency} at a time)\n"
        f"  {peer_name:<12}  {result['transformers_texts_per_s']:8.1f} texts/s  (batches of {args.peer_batch_size})\n"
        f"  jaxserve / {peer_name} = {result['ratio_jaxserve_over_transformers']:.2f}; largest difference of the "
        f"unit vectors {result['max_abs_diff']:.1e}"
    )
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(result, indent=2))
    return 0


def _peer_job(args: argparse.Namespace, peer: str, runs: list[list[str]], ids: list[list[list[int]]]) -> dict:
    """What the peer embeds: the same texts (sentence-transformers tokenizes them itself), or the
    same token ids on the same GGUF weights (transformers)."""
    common = {"threads": os.cpu_count(), "batch_size": args.peer_batch_size}
    if peer == "sentence-transformers":
        return {**common, "model_dir": str(encoder_dir(args.model)), "runs": runs}
    return {**common, "gguf": str(gguf_path(args.model)), "pooling": args.pooling, "runs": ids}


def _result(
    args: argparse.Namespace,
    server_args: list[str],
    peer_versions: Any,
    ids: list[list[list[int]]],
    timed: list[tuple[float, list]],
    peer: dict[str, Any],
) -> dict[str, Any]:
    """The run's figures: rates (median of the timed runs, the first is a warm-up) and the largest
    difference of the embeddings from the peer's."""
    ours = [seconds for seconds, _ in timed[1:]]
    ours_rate, peer_rate = args.texts / statistics.median(ours), args.texts / statistics.median(peer["seconds"])
    return {
        "system": system_info(),
        "model": args.model,
        "pooling": args.pooling,
        "texts": args.texts,
        "words": list(args.words),
        "mean_tokens_per_text": sum(len(t) for t in ids[1]) / args.texts,
        "request_size": args.request_size,
        "concurrency": args.concurrency,
        "server_args": server_args,
        "peer_batch_size": args.peer_batch_size,
        "peer_versions": peer_versions,
        "jaxserve_seconds": ours,
        "transformers_seconds": peer["seconds"],
        "jaxserve_texts_per_s": ours_rate,
        "transformers_texts_per_s": peer_rate,
        "ratio_jaxserve_over_transformers": ours_rate / peer_rate,
        "max_abs_diff": float(np.max(np.abs(np.array(timed[1][1]) - np.array(peer["embeddings"])))),
    }


if __name__ == "__main__":
    raise SystemExit(main())
