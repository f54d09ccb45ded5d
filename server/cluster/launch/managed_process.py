"""A `jaxserve worker` or `jaxserve router` run as a child process of a Ray actor, on the node
(and with the devices) Ray placed the actor on.

The class is plain Python; `jaxserve launch` wraps it with `ray.remote`, so Ray's scheduling
(placement-group bundles, CUDA_VISIBLE_DEVICES for the bundle's GPUs) applies to the actor and the
child inherits it. The child's output is echoed line by line, prefixed with its name: Ray forwards
an actor's stdout to the driver, so `jaxserve launch` shows every process's log.

The child starts in the constructor, so that an actor Ray restarts starts it again (with the same
command line: the same port). With `exit_with_child`, a child that exits unless `stop` asked it to
takes the actor down with it, which is what lets Ray restart the actor (its `max_restarts`): once
it has served, or from the start in a restarted actor (the first start's failure is the launch's,
reported by `wait_ready`).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def node_address() -> str:
    """The address the Ray cluster reaches this node at (where a worker listens)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def free_port(host: str) -> int:
    """A port of `host` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_and_port() -> tuple[str, int]:
    """Run as a Ray task in a worker's bundle: its node's address and a port free there (on every
    address of the node, so the loopback one may be used as well)."""
    return node_address(), free_port("")


class ManagedProcess:
    def __init__(self, name: str, argv: list[str], ready_pattern: str, exit_with_child: bool = False) -> None:
        """Start `jaxserve <argv>`; `ready_pattern`'s first group, in the line that matches it, is
        the address the process serves on (`wait_ready`)."""
        import ray

        self.name = name
        self._stopping = False
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._found: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        print(f"[{name}] started pid {self.proc.pid}", flush=True)
        threading.Thread(target=self._pump, args=(ready_pattern, exit_with_child), daemon=True).start()

    def _pump(self, ready_pattern: str, exit_with_child: bool) -> None:
        for line in self.proc.stdout:
            print(f"[{self.name}] {line.rstrip()}", flush=True)
            if not self._ready.is_set() and (match := re.search(ready_pattern, line)):
                self._found.append(match.group(1))
                self._ready.set()
        self._ready.set()  # the child exited
        code = self.proc.wait()
        if exit_with_child and not self._stopping and (self._found or self._restarted):
            print(f"[{self.name}] exited with status {code}; its actor exits too (Ray restarts it)", flush=True)
            os._exit(1)

    def wait_ready(self, timeout: float) -> str:
        """The address from the ready line. RuntimeError if the child exits or stays silent for
        `timeout` seconds first (it is killed then)."""
        if not self._ready.wait(timeout):
            self._stopping = True
            self.proc.kill()
            raise RuntimeError(f"{self.name} printed no line matching the ready pattern in {timeout:.0f} s")
        if not self._found:
            raise RuntimeError(f"{self.name} exited with status {self.proc.wait()} before it served")
        return self._found[0]

    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> int | None:
        """None while the child runs, else its exit status."""
        return self.proc.poll()

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (a clean shutdown: calls in flight finish), SIGKILL after `timeout` seconds."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.wait()
