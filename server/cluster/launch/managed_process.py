"""A `jaxserve worker` or `jaxserve router` run as a child process of a Ray actor, on the node
(and with the devices) Ray placed the actor on.

The class is plain Python; `jaxserve launch` wraps it with `ray.remote`, so Ray's scheduling
(placement-group bundles, CUDA_VISIBLE_DEVICES for the bundle's GPUs) applies to the actor and the
child inherits it. The child's output is echoed line by line, prefixed with its name: Ray forwards
an actor's stdout to the driver, so `jaxserve launch` shows every process's log.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time


class ManagedProcess:
    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen | None = None

    def node_address(self) -> str:
        """The address the Ray cluster reaches this node at (where a worker listens)."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)

    def start(self, argv: list[str], ready_pattern: str, timeout: float) -> str:
        """Run `jaxserve <argv>` and wait for the output line matching `ready_pattern`; return its
        first group (the address the process serves on). RuntimeError if the child exits or stays
        silent for `timeout` seconds first (it is killed then)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        found: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                print(f"[{self.name}] {line.rstrip()}", flush=True)
                if not ready.is_set() and (match := re.search(ready_pattern, line)):
                    found.append(match.group(1))
                    ready.set()
            ready.set()  # the child exited

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout):
            self.proc.kill()
            raise RuntimeError(f"{self.name} printed no line matching {ready_pattern!r} in {timeout:.0f} s")
        if not found:
            raise RuntimeError(f"{self.name} exited with status {self.proc.wait()} before it served")
        return found[0]

    def returncode(self) -> int | None:
        """None while the child runs, else its exit status."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (a clean shutdown: calls in flight finish), SIGKILL after `timeout` seconds."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.wait()
