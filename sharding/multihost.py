"""Multi-host serving: one JAX process per host; in each replica group the scheduler runs on the
group's leader only (`sharding.process_layout`).

Every process of a group holds its shards of the group's parameters and KV cache and must launch
the same computations in the same order (each step's collectives span the group's processes).
The leader runs the engine; a `Leader` sets its runner's `mirror` hook so each device operation
(an iteration's model or sampler phase with its bucketed arrays, a block move, a LoRA slot write:
`ModelRunner._device`) is broadcast by `StepChannel.send` before the leader runs it. The group's
other processes sit in `follow`, receiving and replaying operations until `Leader.stop`. Groups
do not wait on one another: a channel's collective spans its group's devices only.

Two timeouts shape the protocol. Gloo gives a group's first collective 30 s for every process
to arrive, and warm-ups on different processes can finish minutes apart: `barrier` (on the
coordination service, with its own timeout) lines them up first. And a follower blocked in a
broadcast must not wait on an idle server forever: the engine thread calls
`Leader.keep_alive` when it has nothing to do, which sends a no-op every few seconds.

Messages are pickled and broadcast in two collectives over the group's devices: the byte length,
then the bytes padded to a power of two (so the broadcast compiles once per size class, not once
per message).

`initialize` starts `jax.distributed` from arguments or the environment
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), using gloo collectives on
CPU. Call it before anything else touches JAX. `publish` and `lookup` share short strings (a
group's worker address) through the job's coordination service.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.process_layout import ProcessLayout, plan_processes

_MIN_PAYLOAD = 1 << 12
_STOP = ("stop",)
_NOOP = ("noop",)


def add_distributed_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--coordinator-address`, `--num-processes`, `--process-id` (default: the environment)."""
    parser.add_argument(
        "--coordinator-address", default=None, help="host:port of process 0's coordinator (env JAX_COORDINATOR_ADDRESS)"
    )
    parser.add_argument("--num-processes", type=int, default=None, help="processes in the job (env JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None, help="this process's index (env JAX_PROCESS_ID)")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    independent_groups: bool = False,
) -> bool:
    """Join a multi-process JAX job; False (and nothing done) when no process count > 1 is given.

    `independent_groups` (a job of several replica groups, `sharding.process_layout`): a process
    that dies takes down its own group only. By default the coordination service stops every
    process of the job once one stops sending heartbeats; with it, the others serve on."""
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
    if independent_groups:
        jax.config.update("jax_enable_recoverability", True)
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


def barrier(name: str, timeout_s: float = 1800.0, processes: Sequence[int] | None = None) -> None:
    """Wait until every process (or each of `processes`) reaches `barrier(name)`. Uses the
    coordination service, not a device collective, so slow warm-ups on some processes do not trip
    gloo's 30 s limit."""
    _client().wait_at_barrier(name, int(timeout_s * 1000), None if processes is None else list(processes))


def _client() -> Any:
    from jax._src import distributed  # the public sync_global_devices is a gloo collective

    return distributed.global_state.client


def publish(key: str, value: str) -> None:
    """Make `value` readable by every process of the job under `key` (replacing what was there)."""
    _client().key_value_set(key, value, allow_overwrite=True)


def lookup(key: str, timeout_s: float) -> str:
    """The value some process `publish`ed under `key`, waiting up to `timeout_s` for it."""
    return _client().blocking_key_value_get(key, int(timeout_s * 1000))


def reachable_address() -> str:
    """This host's address on its route to the job's coordinator (127.0.0.1 when the coordinator
    listens on loopback): where the job's other processes reach a service of this process."""
    from jax._src import distributed

    host = distributed.global_state.coordinator_address.rpartition(":")[0].strip("[]")
    family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)  # a datagram socket sends nothing: this only picks the route
        return probe.getsockname()[0]


def job_layout(data_parallel_size: int, devices_per_replica: int) -> ProcessLayout:
    """This job's replica groups (`plan_processes` over the job's processes and devices)."""
    return plan_processes(data_parallel_size, devices_per_replica, jax.local_device_count(), jax.process_count())


def group_devices(layout: ProcessLayout, group: int) -> list:
    """The devices of `group`'s processes, in the job's device order."""
    members = set(layout.members(group))
    return [d for d in jax.devices() if d.process_index in members]


class Replayer(Protocol):
    mirror: Any

    def replay(self, op: tuple) -> None: ...


class StepChannel:
    """Broadcasts Python objects from the process of `devices[0]` (a group's leader) to the other
    processes of `devices` (its group; all of them must call in step)."""

    def __init__(self, devices: Sequence[Any]) -> None:
        self._devices = list(devices)
        self._leader = self._devices[0].process_index
        self._local = [d for d in self._devices if d.process_index == jax.process_index()]
        mesh = Mesh(np.array(self._devices, dtype=object), ("device",))
        self._rows = NamedSharding(mesh, PartitionSpec("device"))
        # One row per device, all zero but the leader's: their sum is the leader's row everywhere.
        self._sum = jax.jit(
            lambda rows: jnp.sum(rows, axis=0, dtype=rows.dtype), out_shardings=NamedSharding(mesh, PartitionSpec())
        )

    @property
    def is_leader(self) -> bool:
        return jax.process_index() == self._leader

    def send(self, obj: Any) -> None:
        if not self.is_leader:
            raise RuntimeError("only the group's leader sends")
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self._broadcast(np.array([data.size], np.int32))
        self._broadcast(_padded(data))

    def receive(self) -> Any:
        if self.is_leader:
            raise RuntimeError("the group's leader sends, it does not receive")
        size = int(self._broadcast(np.zeros(1, np.int32))[0])
        data = self._broadcast(np.zeros(_capacity(size), np.uint8))
        return pickle.loads(data[:size].tobytes())

    def _broadcast(self, row: np.ndarray) -> np.ndarray:
        rows = [
            jax.device_put((row if self.is_leader and i == 0 else np.zeros_like(row))[None], device)
            for i, device in enumerate(self._local)
        ]
        stacked = jax.make_array_from_single_device_arrays((len(self._devices), *row.shape), self._rows, rows)
        return np.asarray(self._sum(stacked).addressable_data(0))


def _capacity(size: int) -> int:
    return max(_MIN_PAYLOAD, 1 << (size - 1).bit_length())


def _padded(data: np.ndarray) -> np.ndarray:
    out = np.zeros(_capacity(data.size), np.uint8)
    out[: data.size] = data
    return out


class Leader:
    """A group leader's side: mirrors every device operation of `runner` to its group's other processes."""

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
    """On a group's other processes: replay its leader's operations until it stops; returns how
    many device operations were replayed (keep-alive no-ops not counted)."""
    count = 0
    while (op := channel.receive())[0] != _STOP[0]:
        if op[0] != _NOOP[0]:
            runner.replay(op)
            count += 1
    return count
