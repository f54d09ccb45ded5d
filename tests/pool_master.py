"""A real Mooncake Store master on loopback for the pool-tier tests (`mooncake_master`, from the
`mooncake` extra, which the test extra installs). The tests that need it skip, saying why, where
Mooncake cannot be imported (no x86-64 Linux wheel for the Python, or no libibverbs1)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_mooncake() -> None:
    """Skip the calling test module unless Mooncake Store imports and its master can be started."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.skip(
            f"Mooncake Store is not importable ({e}): pip install 'jaxserve[mooncake]', apt-get install libibverbs1",
            allow_module_level=True,
        )
    if shutil.which("mooncake_master") is None:
        pytest.skip("mooncake_master is not on PATH", allow_module_level=True)


class PoolMaster:
    """One `mooncake_master` process on loopback ports; `kill` and `start` again to test faults."""

    def __init__(self) -> None:
        self.rpc_port = _free_port()
        self.metrics_port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    def start(self) -> None:
        args = [
            "mooncake_master",
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mooncake_master did not listen within 30 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
