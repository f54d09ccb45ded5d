"""Soak: a few thousand mixed requests at once on the tiny model (streams cut off mid-way, n > 1,
stop strings, session turns, edits, forks, cancels and deletes, bad requests), bounded in count
and in time. No 5xx, every stream that is read to its end ends with [DONE], and afterwards the
engine serves with its KV pool back at the idle level (no leaked block, no leaked pin)."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import aiohttp
from server_harness import MODEL_NAME, assert_serving_and_idle, start_server, stream_events

SOAK_KEY = "key-soak"
MAX_REQUESTS = 3000
MIN_REQUESTS = 500  # sent however slow the machine is
MAX_SECONDS = 40.0  # past MIN_REQUESTS, stop starting new requests after this long (CI machines are slow and shared)
CONCURRENCY = 16
CHAT = "/v1/chat/completions"


class Soak:
    def __init__(self, http: aiohttp.ClientSession, rng: random.Random) -> None:
        self.http = http
        self.rng = rng
        self.statuses: collections.Counter = collections.Counter()
        self.num_cut = 0
        self.sessions: list[str] = []

    async def request(
        self, method: str, path: str, body: object = None, *, stream: bool = False, cut_after: int | None = None
    ) -> object:
        """Send one request; read it whole (checking [DONE] on streams) or cut it off after
        `cut_after` events. Returns the JSON body of a whole non-stream 200, else None."""
        async with self.http.request(method, path, json=body) as resp:
            self.statuses[resp.status] += 1
            assert resp.status < 500, (path, resp.status, await resp.text())
            if resp.status != 200:
                error = (await resp.json())["error"]
                assert error["type"] != "server_error" and error["message"]
                return None
            if not stream:
                return await resp.json()
            events = []
            async for event in stream_events(resp):
                events.append(event)
                if cut_after is not None and len(events) >= cut_after:
                    self.num_cut += 1
                    return None  # leaving the block closes the connection: the client is gone
            assert events[-1] == "[DONE]", events[-3:]
            assert not any(isinstance(e, dict) and e.get("error", {}).get("type") == "server_error" for e in events)
        return None

    def sampling(self) -> dict:
        r = self.rng
        body = {"max_tokens": r.randint(1, 12), "temperature": r.choice([0.0, 0.7, 1.0]), "seed": r.randint(0, 99)}
        if r.random() < 0.3:
            body["stop"] = ["".join(r.choices("abcde ", k=r.randint(1, 6))) for _ in range(r.randint(1, 4))]
        if r.random() < 0.2:
            body["ignore_eos"] = True
        return body

    def cut_after(self) -> int | None:
        return self.rng.randint(1, 4) if self.rng.random() < 0.3 else None

    async def one(self) -> None:
        r = self.rng
        kind = r.choices(["completion", "chat", "session", "bad", "tokenize"], weights=[30, 30, 30, 7, 3])[0]
        if kind == "completion":
            stream = r.random() < 0.6
            body = {
                "model": MODEL_NAME,
                "prompt": r.choice(["Hello", ["Hi", "Yo"], [1, 2, 3]]),
                "n": r.randint(1, 3),
                "stream": stream,
                **self.sampling(),
            }
            await self.request(
                "POST", "/v1/completions", body, stream=stream, cut_after=self.cut_after() if stream else None
            )
        elif kind == "chat":
            stream = r.random() < 0.6
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": r.choice(["Hi", "Tell me", "Why?"])}],
                "n": r.randint(1, 2),
                "stream": stream,
                **self.sampling(),
            }
            await self.request("POST", CHAT, body, stream=stream, cut_after=self.cut_after() if stream else None)
        elif kind == "session":
            await self.session_op()
        elif kind == "bad":
            await self.request(
                "POST",
                CHAT,
                r.choice(
                    [
                        {"model": MODEL_NAME, "messages": [{"role": ["user"], "content": "x"}]},
                        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_k": 2**40},
                        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "stop": ["x" * 400]},
                        {"prompt": "x"},
                    ]
                ),
            )
        else:
            await self.request("POST", "/tokenize", {"model": MODEL_NAME, "prompt": "Hello world"})

    async def session_op(self) -> None:
        r = self.rng
        if len(self.sessions) < 3 or r.random() < 0.1:
            created = await self.request("POST", "/v1/sessions", {"system": "Be brief.", "max_tokens": 6})
            if created is not None:
                self.sessions.append(created["id"])
            return
        sid = r.choice(self.sessions)
        op = r.choices(
            ["message", "edit", "fork", "cancel", "delete", "continue", "get"], weights=[40, 10, 8, 8, 6, 8, 20]
        )[0]
        stream = r.random() < 0.5
        if op == "message":
            await self.request(
                "POST",
                f"/v1/sessions/{sid}/messages",
                {"content": "Go on", "stream": stream, **self.sampling()},
                stream=stream,
                cut_after=self.cut_after() if stream else None,
            )
        elif op == "edit":
            await self.request(
                "PUT", f"/v1/sessions/{sid}/messages/{r.randint(0, 3)}", {"content": "Edited", "max_tokens": 4}
            )
        elif op == "fork":
            forked = await self.request("POST", f"/v1/sessions/{sid}/fork", {"at": r.randint(0, 2)})
            if forked is not None:
                self.sessions.append(forked["id"])
        elif op == "cancel":
            await self.request("POST", f"/v1/sessions/{sid}/cancel")
        elif op == "delete":
            if sid in self.sessions:
                self.sessions.remove(sid)
            await self.request("DELETE", f"/v1/sessions/{sid}")
        elif op == "continue":
            await self.request("POST", f"/v1/sessions/{sid}/continue", {"max_tokens": 4})
        else:
            await self.request("GET", f"/v1/sessions/{sid}")


async def _soak(base_url: str) -> tuple[int, float, Soak]:
    started = time.monotonic()
    sent = 0
    async with aiohttp.ClientSession(base_url, headers={"Authorization": f"Bearer {SOAK_KEY}"}) as http:
        soak = Soak(http, random.Random(13))

        async def worker() -> None:
            nonlocal sent
            while sent < MAX_REQUESTS and (sent < MIN_REQUESTS or time.monotonic() - started < MAX_SECONDS):
                sent += 1
                await soak.one()

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return sent, time.monotonic() - started, soak


def test_soak_mixed_traffic_leaves_the_engine_serving_and_idle(async_engine):
    srv = start_server(async_engine, api_keys=(SOAK_KEY,), max_sessions_per_key=16)
    try:
        sent, seconds, soak = asyncio.run(_soak(srv.base_url))
        print(
            f"\nsoak: {sent} requests in {seconds:.1f} s ({CONCURRENCY} at once), {soak.num_cut} streams cut off; "
            f"statuses {dict(sorted(soak.statuses.items()))}"
        )
        assert sent >= MIN_REQUESTS and sum(soak.statuses.values()) == sent
        assert soak.statuses[200] > sent // 2 and soak.num_cut > 0
        assert_serving_and_idle(srv, async_engine, SOAK_KEY)
    finally:
        srv.stop()
