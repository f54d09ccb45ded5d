"""Which Ray cluster `jaxserve launch` runs on, settled before Ray is asked, so that a launch
never waits minutes on a cluster that is gone.

- No `--address` (and no RAY_ADDRESS): a local cluster of the launcher's own (`LocalCluster`), for
  its lifetime, bound to `--node-ip-address` (loopback by default), its files in a temporary
  directory removed when it stops. Ray's discovery file is neither read nor written: one left
  behind by an earlier `ray start` (or a test) must not decide where a newcomer's launch goes.
- `--address HOST:PORT` (or `ray://HOST:PORT`), or RAY_ADDRESS: that cluster.
- `--address auto`: RAY_ADDRESS, else the cluster Ray's discovery file names (the last `ray start`
  on this machine).

A named cluster must accept a TCP connection within a few seconds, else the launch stops with a
message saying which address it tried and where it came from.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

CONNECT_TIMEOUT = 3.0  # seconds a named cluster's head has to accept a connection
HEAD_READY = "Ray runtime started"


class ClusterNotFoundError(RuntimeError):
    """No Ray cluster answers where the launch was told (or Ray's discovery file says) to look."""


@dataclasses.dataclass(frozen=True)
class RayTarget:
    """What to pass to `ray.init`: an address (None: start a local cluster) and where it came from."""

    address: str | None
    source: str


def discovery_file(environ: Mapping[str, str] = os.environ) -> Path:
    """Where `ray start` records the cluster it started (Ray's own rule for its temp directory)."""
    base = environ.get("RAY_TMPDIR") or environ.get("TMPDIR") or "/tmp"
    return Path(base) / "ray" / "ray_current_cluster"


def choose_cluster(address: str | None, environ: Mapping[str, str] = os.environ) -> RayTarget:
    """The cluster a launch uses (see the module's docstring); ClusterNotFoundError when `auto`
    finds none."""
    env = environ.get("RAY_ADDRESS", "")
    if address is None:
        return RayTarget(env, "RAY_ADDRESS") if env else RayTarget(None, "a local cluster")
    if address != "auto":
        return RayTarget(address, "--address")
    if env:
        return RayTarget(env, "RAY_ADDRESS")
    path = discovery_file(environ)
    try:
        found = path.read_text().strip()
    except OSError:
        found = ""
    if not found:
        raise ClusterNotFoundError(
            f"--address auto: RAY_ADDRESS is unset and {path} names no cluster; "
            "leave out --address to start a local cluster"
        )
    return RayTarget(found, f"Ray's discovery file {path}")


def check_reachable(target: RayTarget, timeout: float = CONNECT_TIMEOUT) -> None:
    """ClusterNotFoundError unless the target's head accepts a TCP connection within `timeout` s
    (a local cluster, not started yet, passes)."""
    if target.address is None:
        return
    host, sep, port = target.address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterNotFoundError(f"{target.source} gives {target.address!r}; a Ray cluster is HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        stale = " (a stale file: its cluster has stopped)" if "discovery file" in target.source else ""
        raise ClusterNotFoundError(
            f"no Ray cluster answers at {target.address}, from {target.source}{stale}: {e}. Leave out --address "
            "(and unset RAY_ADDRESS) to start a local cluster, or name a running one with --address HOST:PORT"
        ) from None


def _stop_with_parent() -> None:
    """In the head's process before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux;
    elsewhere nothing), so that its cluster does not outlive it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalCluster:
    """A one-node Ray cluster for one launch: `ray start --head --block` bound to `host`, with its
    sessions, logs and discovery file in a temporary directory. Use it as a context manager: the
    head stops (SIGTERM, which stops every Ray process it started) and the directory goes."""

    def __init__(self, host: str = "127.0.0.1", timeout: float = 120.0) -> None:
        self.host = host
        self.timeout = timeout
        self.address = ""
        self.temp_dir = ""
        self._proc: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=20)

    def __enter__(self) -> LocalCluster:
        self.temp_dir = tempfile.mkdtemp(prefix="jaxserve-ray-")  # short: Ray's socket paths live under it
        with socket.socket() as s:
            s.bind((self.host, 0))
            port = s.getsockname()[1]
        self.address = f"{self.host}:{port}"
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--head",
                "--block",
                "--node-ip-address",
                self.host,
                "--port",
                str(port),
                "--temp-dir",
                self.temp_dir,
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_stop_with_parent,
        )
        ready = threading.Event()

        def pump() -> None:
            for line in self._proc.stdout:
                self._tail.append(line.rstrip())
                if HEAD_READY in line:
                    ready.set()
            ready.set()  # it exited

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(self.timeout) or self._proc.poll() is not None:
            self.__exit__()
            tail = "\n".join(self._tail)
            raise ClusterNotFoundError(
                f"a local Ray cluster on {self.host} did not start within {self.timeout:.0f} s:\n{tail}"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
