"""How many third-party client checks pass against `jaxserve serve`.

    python3 -m bench.client_checks [--model smollm2-135m-instruct] [--client-python PY]
                                   [--base-url URL --served-model NAME] [--server-args ...]

Starts `jaxserve serve` on a free loopback port (or uses `--base-url`), then runs the checks of
`bench/client_check_openai.py` and `bench/client_check_others.py` in `--client-python` (an
interpreter with the client libraries: openai, anthropic, openai-agents, langchain-openai, litellm;
default: this one) and prints each check and the count: passed of those run, with the skipped
(library not installed) named apart. `--json PATH` keeps the results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.server_process import ManagedServer, free_port, jaxserve_argv

SCRIPTS = [Path(__file__).with_name(name) for name in ("client_check_openai.py", "client_check_others.py")]
KEY = "client-checks-key"


def run_checks(client_python: str, base_url: str, model: str) -> list[dict]:
    results = []
    for script in SCRIPTS:
        out = subprocess.run(
            [client_python, str(script), base_url, model, KEY], capture_output=True, text=True, timeout=1800
        )
        ran = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not ran:
            raise SystemExit(f"{script.name} did not run ({out.returncode}):\n{out.stderr[-3000:]}")
        results += ran
    return results


def report(results: list[dict]) -> str:
    lines = [f"{'client':<18} {'check':<34} {'status':<8} {'s':>6}  detail"]
    for r in results:
        lines.append(f"{r['client']:<18} {r['check']:<34} {r['status']:<8} {r['seconds']:>6.2f}  {r['detail']}")
    ran = [r for r in results if r["status"] != "skipped"]
    passed = sum(r["status"] == "passed" for r in ran)
    skipped = sorted({r["client"] for r in results if r["status"] == "skipped"})
    lines.append(
        f"\n{passed} of {len(ran)} third-party client checks passed" + (f"; skipped: {skipped}" if skipped else "")
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--client-python", default=sys.executable)
    parser.add_argument("--base-url", help="a running server (its API key must be none or " + KEY + ")")
    parser.add_argument("--served-model", help="the model name the running server serves")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.base_url:
        results = run_checks(args.client_python, args.base_url, args.served_model or args.model)
    else:
        port = free_port()
        argv = jaxserve_argv(args.model, port, ["--api-key", KEY, *args.server_args])
        with ManagedServer(argv, port, name="jaxserve") as server:
            results = run_checks(args.client_python, server.base_url, args.model)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
