"""Time to a tool call's first argument byte, streamed, against the whole call not streamed.

    python3 -m bench.tool_call_latency [--model smollm2-135m-instruct] [--rounds 5] [--server-args ...]

Starts `jaxserve serve` on a free loopback port and sends, through the official `openai` client, one
chat request whose `tool_choice` forces `get_weather(city)`: streamed (the time to the first delta
carrying argument text, and to the stream's end) and not streamed (the time to the whole reply),
alternated for `--rounds`. Prints the medians, the streamed first argument byte as a share of the
whole call's time, and checks that the streamed fragments add up to the non-streamed arguments.
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from bench.server_process import ManagedServer, free_port, jaxserve_argv

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


def _whole(client: openai.OpenAI, model: str) -> tuple[float, str]:
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=FORCED, temperature=0, max_tokens=64
    )
    return time.perf_counter() - start, reply.choices[0].message.tool_calls[0].function.arguments


def _streamed(client: openai.OpenAI, model: str) -> tuple[float, float, str]:
    start = time.perf_counter()
    first, arguments = None, ""
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=FORCED, temperature=0, max_tokens=64, stream=True
    )
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function is not None and call.function.arguments:
                first = time.perf_counter() - start if first is None else first
                arguments += call.function.arguments
    return first if first is not None else float("nan"), time.perf_counter() - start, arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server-args", nargs="*", default=[])
    args = parser.parse_args()
    port = free_port()
    with ManagedServer(jaxserve_argv(args.model, port, args.server_args), port, name="jaxserve") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        model = client.models.list().data[0].id
        _whole(client, model)  # warm the server's paths once
        firsts, ends, wholes, same = [], [], [], True
        for _ in range(args.rounds):
            first, end, streamed_args = _streamed(client, model)
            whole, whole_args = _whole(client, model)
            firsts.append(first)
            ends.append(end)
            wholes.append(whole)
            same &= streamed_args == whole_args
    first, end, whole = statistics.median(firsts), statistics.median(ends), statistics.median(wholes)
    print(f"{args.model}, forced get_weather, {args.rounds} rounds alternated (medians):")
    print(f"  streamed: first argument byte {first * 1000:.0f} ms, end {end * 1000:.0f} ms")
    print(f"  not streamed: whole call {whole * 1000:.0f} ms")
    print(
        f"  first argument byte / whole call: {first / whole:.2f}; arguments {'equal' if same else 'DIFFER'}: "
        f"{whole_args}"
    )


if __name__ == "__main__":
    main()
