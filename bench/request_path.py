"""The files a chat request passes through, from the HTTP handler to the engine loop's queue.

`python3 -m bench.request_path` serves the tiny random model in this process, sends one
`/v1/chat/completions` request and records, with a profiler on every thread, each call into the
repository's code from the moment the route handler starts until the scheduler queues the
request on the engine thread (`Scheduler.add_request`). It prints:

- the path: the files of the call stacks that carry the request down the layers (the handler's
  as it starts the generation, the generation task's as it hands the request to the engine
  thread, the engine thread's as the request reaches the scheduler), and how often that path
  returns to a file it had left;
- every repository file the request's handling entered (the path and the helpers it calls and
  returns from: request validation, chat templates, tokenizing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START = ("server/routes_openai.py", "chat_completions")
# Where the stacks that carry the request are read: the handler's (it starts the generation's task),
# that task's (it hands the request to the engine thread), the engine thread's (the scheduler).
CARRIERS = (("server/generation.py", "deltas"), ("jaxserve/async_engine.py", "generate"))
END = ("jaxserve/scheduler/scheduler.py", "add_request")


PACKAGES = ("jaxserve/", "server/", "checkpoints/", "sharding/", "kernels_pallas/")


def _repository_file(filename: str) -> str | None:
    """The repository path of a source file of the product's packages, else None."""
    if not filename.endswith(".py"):
        return None
    try:
        rel = Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return rel if rel.startswith(PACKAGES) else None


def _stack_files(frame) -> list[str]:  # noqa: ANN001 - a frame
    """The repository files of the frames from the outermost to `frame` (one entry per run)."""
    files: list[str] = []
    while frame is not None:
        rel = _repository_file(frame.f_code.co_filename)
        if rel is not None and (not files or files[-1] != rel):
            files.append(rel)
        frame = frame.f_back
    return files[::-1]


class PathRecorder:
    """Call events of repository code between START and END, per thread, as (depth, file, function)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str, str]] = []
        self.started = self.ended = False
        self._stacks: dict[int, list[str]] = {}
        self.path: list[str] = []  # the handing-on stacks' files, outermost first

    def profile(self, frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event not in ("call", "return") or self.ended:
            return
        rel = _repository_file(frame.f_code.co_filename)
        if rel is None:
            return
        name = threading.current_thread().name
        stack = self._stacks.setdefault(threading.get_ident(), [])
        if event == "return":
            if stack:
                stack.pop()
            return
        if (rel, frame.f_code.co_name) == START:
            self.started = True
        if self.started:
            self.calls.append((name, len(stack), rel, frame.f_code.co_name))
        stack.append(rel)
        if self.started and (rel, frame.f_code.co_name) in (*CARRIERS, END) and not self.ended:
            self.path += _stack_files(frame)
            self.ended = (rel, frame.f_code.co_name) == END


def _tiny_engine() -> Any:
    """The engine of a server over the tiny random model, warmed up and started."""
    from checkpoints.tiny_random import build_tiny_random
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=8,
        num_blocks=64,
        decode_batch_buckets=(4,),
        prefill_token_buckets=(64,),
        prefill_seq_buckets=(4,),
        block_table_buckets=(32,),
        sampler_row_buckets=(4,),
    )
    engine = AsyncEngine(LLMEngine(build_tiny_random(), config))
    engine.engine.warm_up()
    engine.start()
    return engine


async def _record_a_chat(engine: Any, recorder: PathRecorder) -> None:
    """Serve two chat requests on a loopback port; record the calls of the second (both threads)."""
    import aiohttp
    from aiohttp import web

    from server.app import build_app
    from server.config import ServerConfig

    runner = web.AppRunner(build_app(engine, ServerConfig(served_model_name="tiny-random")))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with http.post(url, json=body) as resp:  # first: lazy imports and caches
            await resp.json()
        await engine.inspect(lambda _engine: sys.setprofile(recorder.profile))  # the engine thread
        sys.setprofile(recorder.profile)
        try:
            async with http.post(url, json=body) as resp:
                reply = await resp.json()
        finally:
            sys.setprofile(None)
            await engine.inspect(lambda _engine: sys.setprofile(None))
    assert "choices" in reply, json.dumps(reply)
    await runner.cleanup()


def _print_path(recorder: PathRecorder, tree: bool) -> None:
    files: list[str] = []
    for thread, depth, rel, function in recorder.calls:
        if rel not in files:
            files.append(rel)
        if tree:
            print(f"{thread:>16} {'  ' * depth}{rel}:{function}")
    path = [rel for i, rel in enumerate(recorder.path) if i == 0 or recorder.path[i - 1] != rel]
    returns = [rel for i, rel in enumerate(path) if rel in path[:i]]
    print("the path (asyncio side, then the engine thread):")
    print("  " + " -> ".join(path))
    print(
        f"path: {len(set(path))} files, {len(returns)} returns to a file it had left ({', '.join(returns) or 'none'})"
    )
    print("every repository file entered, in order:")
    for i, rel in enumerate(files, 1):
        print(f"  {i:2d}. {rel}")
    print(f"entered: {len(files)} files")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="store_true", help="print every call, not just the files")
    args = parser.parse_args(argv)
    engine = _tiny_engine()
    recorder = PathRecorder()
    asyncio.run(_record_a_chat(engine, recorder))
    engine.shutdown()
    _print_path(recorder, args.tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
