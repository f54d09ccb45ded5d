"""The load generator: sends a workload to one endpoint with Poisson or closed-loop arrivals.

Open loop: items start at the times of a Poisson process of rate `request_rate` (seeded, so every
backend sees the same schedule). Closed loop: at most `max_concurrency` items in flight; with an
infinite rate, a new one starts as soon as one finishes. Both limits may be combined, as in vLLM.
A conversation is one item: its turns go one after another, each after the previous reply.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from bench import http_client
from bench.http_client import Endpoint
from bench.metrics import RequestRecord
from bench.workloads import BenchRequest, Conversation, TokenizerLike, Workload

MULTI_TURN_APIS = ("history", "sessions")
SINGLE_TURN_APIS = ("completions", "chat")


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    request_rate: float = math.inf  # items per second (Poisson); inf: all at once
    max_concurrency: int | None = None  # items in flight at most; None: no limit
    seed: int = 0
    api: str = "completions"  # how single-turn items are sent: completions | chat
    multi_turn_api: str = "history"  # how conversations are sent: history (chat) | sessions
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("request_rate must be positive (inf for no pacing)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.api not in SINGLE_TURN_APIS:
            raise ValueError(f"api must be one of {SINGLE_TURN_APIS}")
        if self.multi_turn_api not in MULTI_TURN_APIS:
            raise ValueError(f"multi_turn_api must be one of {MULTI_TURN_APIS}")

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return out


def arrival_times(num_items: int, request_rate: float, seed: int) -> list[float]:
    """Start offsets in seconds: a Poisson process (exponential gaps), or all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num_items
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_items)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]


def num_requests(workload: Workload) -> int:
    return sum(len(i.turns) if isinstance(i, Conversation) else 1 for i in workload.items)


async def _send_request(http: aiohttp.ClientSession, endpoint: Endpoint, item: BenchRequest, spec: LoadSpec,
                        tokenizer: TokenizerLike) -> RequestRecord:  # fmt: skip
    if spec.api == "completions" and not item.images:
        return await http_client.completion(http, endpoint, item.prompt, item.max_tokens, item.prompt_len, item.group)
    text = item.prompt if isinstance(item.prompt, str) else tokenizer.decode(item.prompt)
    messages = [{"role": "user", "content": _content(text, item.images)}]
    return await http_client.chat(http, endpoint, messages, item.max_tokens, item.prompt_len, item.group)


def _content(text: str, images: tuple[bytes, ...]) -> str | list[dict[str, Any]]:
    """A user message's content: the text, after its images as data URLs (chat completions' parts)."""
    if not images:
        return text
    urls = ("data:image/png;base64," + base64.b64encode(png).decode() for png in images)
    return [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": text}]


def _turn_group(conversation: Conversation, turn: int) -> str:
    label = "turn-1" if turn == 0 else "turn-2+"
    return f"{conversation.group}:{label}" if conversation.group else label


async def _run_conversation(http: aiohttp.ClientSession, endpoint: Endpoint, item: Conversation, spec: LoadSpec,
                            on_record: Callable[[RequestRecord], None]) -> None:  # fmt: skip
    """Send the turns in order; a failed turn ends the conversation (its later turns are not sent)."""
    if spec.multi_turn_api == "sessions":
        try:
            session_id = await http_client.create_session(http, endpoint, item.system)
        except (aiohttp.ClientError, RuntimeError, KeyError, ValueError) as e:
            now = time.perf_counter()
            on_record(RequestRecord(now, now, [], 0, 0, False, f"creating the session: {e}", _turn_group(item, 0)))
            return
        try:
            for k, content in enumerate(item.turns):
                record = await http_client.session_turn(http, endpoint, session_id, content, item.max_tokens, 0,
                                                        _turn_group(item, k))  # fmt: skip
                on_record(record)
                if not record.success:
                    return
        finally:
            await http_client.delete_session(http, endpoint, session_id)
        return
    messages = [{"role": "system", "content": item.system}] if item.system else []
    for k, content in enumerate(item.turns):
        messages.append({"role": "user", "content": content})
        record = await http_client.chat(http, endpoint, list(messages), item.max_tokens, 0, _turn_group(item, k))
        on_record(record)
        if not record.success:
            return
        messages.append({"role": "assistant", "content": record.output_text})


async def run_load(endpoint: Endpoint, workload: Workload, spec: LoadSpec, tokenizer: TokenizerLike,
                   show_progress: bool = True, label: str = "") -> tuple[list[RequestRecord], float]:  # fmt: skip
    """Send the whole workload; returns every request's record and the run's duration in seconds."""
    records: list[RequestRecord] = []
    bar = tqdm(total=num_requests(workload), disable=not show_progress, unit="req", desc=label or endpoint.base_url)

    def on_record(record: RequestRecord) -> None:
        records.append(record)
        bar.update(1)

    limit = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    offsets = arrival_times(len(workload.items), spec.request_rate, spec.seed)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
    # Concurrency is ours to limit, not the pool's. A connection per request (as vLLM's benchmark
    # client): llama-server closes a kept-alive connection after a few requests, and a request
    # written into one it is closing fails before the server has read it.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        start = time.perf_counter()

        async def one(item: BenchRequest | Conversation, offset: float) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if limit is not None:
                await limit.acquire()
            try:
                if isinstance(item, Conversation):
                    await _run_conversation(http, endpoint, item, spec, on_record)
                else:
                    on_record(await _send_request(http, endpoint, item, spec, tokenizer))
            finally:
                if limit is not None:
                    limit.release()

        await asyncio.gather(*(one(item, t) for item, t in zip(workload.items, offsets)))
        duration = time.perf_counter() - start
    bar.close()
    return records, duration
