"""Multi-host serving: one JAX process per host, the scheduler on process 0 only.

Every process holds its shards of the parameters and KV cache and must launch the same
computations in the same order (each step's collectives span all processes). Process 0 runs
the engine; a `Leader` sets its runner's `mirror` hook so each device operation (the bucketed
arrays of a step, or a block move) is broadcast by `StepChannel.send` before process 0 runs it.
The other processes sit in `follow`, receiving and replaying operations until `Leader.stop`.

Two timeouts shape the protocol. Gloo gives a group's first collective 30 s for every process
to arrive, and warm-ups on different processes can finish minutes apart: `barrier` (on the
coordination service, with its own timeout) lines them up first. And a follower blocked in a
broadcast must not wait on an idle server forever: the engine thread calls
`Leader.keep_alive` when it has nothing to do, which sends a no-op every few seconds.

Messages are pickled and broadcast with `multihost_utils.broadcast_one_to_all` in two
collectives: the byte length, then the bytes padded to a power of two (so the broadcast
compiles once per size class, not once per message).

`initialize` starts `jax.distributed` from arguments or the environment
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), using gloo collectives on
CPU. Call it before anything else touches JAX.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

_MIN_PAYLOAD = 1 << 12
_STOP = ("stop",)
_NOOP = ("noop",)


def add_distributed_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--coordinator-address`, `--num-processes`, `--process-id` (default: the environment)."""
    parser.add_argument("--coordinator-address", default=None,
                        help="host:port of process 0's coordinator (env JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, default=None, help="processes in the job (env JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None, help="this process's index (env JAX_PROCESS_ID)")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process JAX job; False (and nothing done) when no process count > 1 is given."""
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if num_processes is None or num_processes == 1:
        return False
    if coordinator_address is None or process_id is None:
        raise ValueError(
            f"a {num_processes}-process job needs a coordinator address and a process id "
            "(--coordinator-address / --process-id or JAX_COORDINATOR_ADDRESS / JAX_PROCESS_ID)"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in [0, {num_processes})")
    # CPU collectives across processes need an implementation; GPUs bring their own (NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {value!r}") from None


def barrier(name: str, timeout_s: float = 1800.0) -> None:
    """Wait until every process reaches `barrier(name)`. Uses the coordination service, not a
    device collective, so slow warm-ups on some processes do not trip gloo's 30 s limit."""
    from jax._src import distributed  # the public sync_global_devices is a gloo collective

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


class Replayer(Protocol):
    mirror: Any

    def replay(self, op: tuple) -> None: ...


class StepChannel:
    """Broadcasts Python objects from process 0 to all processes (all must call in step)."""

    def send(self, obj: Any) -> None:
        if jax.process_index() != 0:
            raise RuntimeError("only process 0 sends")
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        multihost_utils.broadcast_one_to_all(np.array([data.size], np.int64))
        multihost_utils.broadcast_one_to_all(_padded(data))

    def receive(self) -> Any:
        if jax.process_index() == 0:
            raise RuntimeError("process 0 sends, it does not receive")
        size = int(multihost_utils.broadcast_one_to_all(np.zeros(1, np.int64))[0])
        data = multihost_utils.broadcast_one_to_all(np.zeros(_capacity(size), np.uint8))
        return pickle.loads(data[:size].tobytes())


def _capacity(size: int) -> int:
    return max(_MIN_PAYLOAD, 1 << (size - 1).bit_length())


def _padded(data: np.ndarray) -> np.ndarray:
    out = np.zeros(_capacity(data.size), np.uint8)
    out[: data.size] = data
    return out


class Leader:
    """Process 0's side: mirrors every device operation of `runner` to the other processes."""

    def __init__(self, runner: Replayer, channel: StepChannel, keep_alive_s: float = 5.0) -> None:
        self._channel = channel
        self._keep_alive_s = keep_alive_s
        self._last_send = time.monotonic()
        runner.mirror = self.send

    def send(self, op: tuple) -> None:
        self._channel.send(op)
        self._last_send = time.monotonic()

    def keep_alive(self) -> None:
        """Call from the thread that runs the engine when it is idle: a no-op every few
        seconds keeps the followers' pending broadcast from timing out."""
        if time.monotonic() - self._last_send >= self._keep_alive_s:
            self.send(_NOOP)

    def stop(self) -> None:
        """Release the followers from `follow`."""
        self.send(_STOP)


def follow(runner: Replayer, channel: StepChannel) -> int:
    """On the other processes: replay process 0's operations until it stops; returns how many
    device operations were replayed (keep-alive no-ops not counted)."""
    count = 0
    while (op := channel.receive())[0] != _STOP[0]:
        if op[0] != _NOOP[0]:
            runner.replay(op)
            count += 1
    return count
