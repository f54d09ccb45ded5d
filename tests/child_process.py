"""Commands (`jaxserve serve`, multi-process workers) run as child processes by tests: a free
loopback port, the child's output lines as they come, waiting for a line, a clean exit."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

# Small buckets for `jaxserve serve` children: each one costs seconds of compilation on CI. And f32
# weights, not the bf16 that `--dtype auto` picks on an AVX512-BF16 CPU: these tests hold outputs
# that take different paths (recomputed after a failover, handed off between workers, batched
# otherwise, read back from disk) to exact equality. In f32 those paths differ by ~1e-6; a bf16
# model rounds its queries, products and KV cache to bf16, which turns such differences into flips
# at the tiny random model's near-ties (a resumed stream's text differed once in a full run). The
# bf16 engine has its own tests: tests/test_model_dtype.py, the accuracy tests, the kernels'.
SMALL_ENGINE = [
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--max-model-len",
    "256",
    "--block-size",
    "8",
    "--num-blocks",
    "128",
    "--decode-batch-buckets",
    "4",
    "--prefill-token-buckets",
    "32",
    "--prefill-seq-buckets",
    "4",
    "--block-table-buckets",
    "32",
    "--dtype",
    "float32",
]


def small_engine_kwargs() -> dict:
    """SMALL_ENGINE as `EngineConfig` keyword arguments, for an in-process engine to compare with."""
    args = iter(SMALL_ENGINE)
    flags = {flag[2:].replace("-", "_"): int(value) if value.isdigit() else value for flag, value in zip(args, args)}
    return {name: (value,) if name.endswith("_buckets") else value for name, value in flags.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxserve(*args: str) -> list[str]:
    """The command line of `jaxserve <args>` in this interpreter."""
    return [sys.executable, "-m", "jaxserve.cli", *args]


class ChildProcess:
    """A child with stdout and stderr merged, read line by line on a thread. Use it as a context
    manager: a child still running at the end is killed."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
        )
        self.seen: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        """The first output line containing `needle` (AssertionError if the child exits first)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if needle in line:
                    return line
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, f"the child exited before printing {needle!r}:\n" + self.output
            self.seen.append(line)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for the child to exit; read the rest of its output; return its exit status."""
        code = self.proc.wait(timeout)
        while (line := self._lines.get(timeout=10)) is not None:
            self.seen.append(line)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.seen)

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
