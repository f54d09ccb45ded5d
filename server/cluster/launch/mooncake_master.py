"""A Mooncake Store master (`mooncake_master`, from the `mooncake` extra) as a child process, the
pool that `--kv-pool` names, for the benchmarks and the tests. (In a deployment it is started as
docs/deployment.md shows.)"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mooncake_missing() -> str | None:
    """Why a pool cannot run here (None: it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"Mooncake Store is not importable ({e}): pip install 'jaxserve[mooncake]', apt-get install libibverbs1"
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not on PATH"
    return None


class PoolMaster:
    """One `mooncake_master` process (free ports on `host` unless given); `kill` and `start` again
    to restart it (a restarted master holds nothing)."""

    def __init__(self, host: str = "127.0.0.1", rpc_port: int | None = None, metrics_port: int | None = None) -> None:
        self.host = host
        self.rpc_port = rpc_port or _free_port()
        self.metrics_port = metrics_port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.rpc_port}"

    def start(self) -> None:
        args = [
            "mooncake_master",
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--metrics_host={self.host}",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            try:
                socket.create_connection((self.host, self.rpc_port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mooncake_master did not listen within 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
