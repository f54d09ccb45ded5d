"""What the client checks of `bench.client_checks` share: the server they talk to, the request
pieces, the registry of checks and the loop that runs them.

The check scripts (`client_check_openai.py`: the `openai` SDK; `client_check_others.py`: the
`anthropic` SDK, the OpenAI Agents SDK, langchain-openai, litellm) run in the interpreter that has the
clients and import no jaxserve code:

    python bench/client_check_openai.py BASE_URL MODEL API_KEY

Each check uses one library the way its documentation shows and asserts what a user of that feature
relies on: the reply's shape and the values the request asked for (a forced tool's arguments in the
schema's shape, a strict JSON schema's keys, streamed fragments adding up to the whole, the API's own
error types). A library that is not installed makes its checks "skipped", never "passed". One JSON
line per check goes to stdout: {"client", "check", "status": "passed" | "failed" | "skipped",
"detail", "seconds"}.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable

BASE, MODEL, KEY = sys.argv[1:4] if len(sys.argv) >= 4 else ("", "", "")
SHORT = 16  # generated tokens where the content does not matter
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}  # the get_weather: no additionalProperties, so strict by default
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": CITY_SCHEMA},
}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

CHECKS: list[tuple[str, str, Callable[[], None]]] = []


def check(client: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CHECKS.append((client, fn.__name__, fn))
        return fn

    return register


def city_only(arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(args) == {"city"} and isinstance(args["city"], str), f"arguments {args!r} are not {{'city': str}}"


MODULES = {
    "openai": "openai",
    "anthropic": "anthropic",
    "openai-agents": "agents",
    "langchain-openai": "langchain_openai",
    "litellm": "litellm",
}


def run_checks() -> None:
    """Run every registered check (the script's own), one JSON line each."""
    for client, name, fn in CHECKS:
        start = time.perf_counter()
        if importlib.util.find_spec(MODULES[client]) is None:
            status, detail = "skipped", f"{client} is not installed in {sys.executable}"
        else:
            try:
                fn()
                status, detail = "passed", ""
            except Exception as e:  # a check's failure, whatever the library raised
                status = "failed"
                detail = f"{type(e).__name__}: {e}"[:400]
        seconds = round(time.perf_counter() - start, 2)
        print(json.dumps({"client": client, "check": name, "status": status, "detail": detail, "seconds": seconds}))
        sys.stdout.flush()
