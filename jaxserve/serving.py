"""The engine of a serving process (`jaxserve serve`, `jaxserve worker`): load the model, compile
every bucket, start the engine loop, and say what it did on stdout.

`jaxserve/cli.py` (the composition root) hands `start_engine` to the server's and the worker's
commands, which see only the `EngineClient` it returns.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import jax

from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine, make_engine
from jaxserve.engine import LLMEngine
from jaxserve.kv import DiskTier
from sharding import multihost
from sharding.process_layout import ProcessLayout


def start_engine(
    model: str, config: EngineConfig, kv_transfer_host: str | None = None, lora_modules: dict[str, str] | None = None
) -> AsyncEngine | None:
    """The started engine of this process, warmed up.

    A dead engine loop (a device step failed) stops the process like SIGTERM, so a serving
    process exits non-zero and its supervisor restarts it. With `kv_transfer_host` (an address
    other workers reach) the engine serves device-to-device KV pulls there. `lora_modules`: LoRA
    adapters (name -> PEFT directory) served from the start.

    In a multi-process job the processes form replica groups (`sharding.process_layout`): each
    group's leader gets the engine of the group's replicas, over the group's devices; the group's
    other processes replay its device operations here until it stops, and get None.
    """
    devices, group = None, None
    if jax.process_count() > 1:
        layout = job_layout(config)
        group = layout.group_of(jax.process_index())
        devices = multihost.group_devices(layout, group)
        config = dataclasses.replace(config, data_parallel_size=layout.replicas_per_group)
    async_engine = AsyncEngine(_load_and_warm_up(model, config, devices, lora_modules))
    if group is not None and layout.processes_per_group > 1 and not _join_group(async_engine, layout, group, devices):
        return None
    if kv_transfer_host is not None:
        try:
            print(f"KV transfer server on {async_engine.start_transfer_server(kv_transfer_host)}", flush=True)
        except ValueError as e:
            raise SystemExit(f"--kv-transport device: {e}; use --kv-transport grpc") from None
    async_engine.on_fatal = lambda _error: os.kill(os.getpid(), signal.SIGTERM)
    async_engine.start()
    return async_engine


def _load_and_warm_up(
    model: str, config: EngineConfig, devices: list | None, lora_modules: dict[str, str] | None
) -> LLMEngine | DataParallelEngine:
    """The engine over `devices`, with its LoRA adapters, every bucket compiled."""
    t0 = time.perf_counter()
    engine = make_engine(model, config, devices)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f} s", flush=True)
    replicas = getattr(engine, "replicas", [engine])
    _add_lora_modules(replicas, lora_modules or {})
    tiers = {id(t): t for e in replicas if e.lower_tier is not None for t in e.lower_tier.tiers}
    for disk in (t for t in tiers.values() if isinstance(t, DiskTier)):
        found = f"{disk.num_blocks} blocks found ({disk.num_bytes / 1e6:.1f} MB)"
        print(f"KV disk tier in {disk.root}: {found}", flush=True)
    on_each = f" on each of {len(replicas)} replicas" if len(replicas) > 1 else ""
    print(f"compiling buckets{on_each}: {replicas[0].runner.bucket_summary()}", flush=True)
    seconds = engine.warm_up()
    print(f"warm-up: {engine.num_compilations} compilations in {seconds:.1f} s", flush=True)
    return engine


def _add_lora_modules(replicas: list[LLMEngine], lora_modules: dict[str, str]) -> None:
    """Each adapter (name -> PEFT directory) on every replica; SystemExit naming the one that fails."""
    for name, path in lora_modules.items():
        try:
            for replica in replicas:
                replica.add_lora(name, path)
        except ValueError as e:
            raise SystemExit(f"--lora-modules {name}={path}: {e}") from None
        print(f"LoRA adapter {name!r} from {path}", flush=True)


def _join_group(async_engine: AsyncEngine, layout: ProcessLayout, group: int, devices: list) -> bool:
    """Join the replica group's processes once all are warm: True on its leader, whose idle engine
    keeps the others alive; the others replay the leader's device operations until it stops, then False."""
    channel = multihost.StepChannel(devices)
    multihost.barrier(f"jaxserve-serve-warm-{group}", processes=layout.members(group))
    runner = async_engine.engine.lone_replica.runner
    if not channel.is_leader:
        count = multihost.follow(runner, channel)
        print(
            f"process {jax.process_index()}: replayed {count} device operations; "
            f"process {layout.members(group)[0]} stopped",
            flush=True,
        )
        return False
    leader = multihost.Leader(runner, channel)
    async_engine.on_idle = leader.keep_alive
    async_engine.on_stopped = leader.stop
    return True


def job_layout(config: EngineConfig) -> ProcessLayout:
    """This multi-process job's replica groups; SystemExit saying what would fit when its
    processes' devices cannot hold `config`'s replicas."""
    per_replica = config.tensor_parallel_size * config.pipeline_parallel_size * config.expert_parallel_size
    try:
        return multihost.job_layout(config.data_parallel_size, per_replica)
    except ValueError as e:
        raise SystemExit(str(e)) from None
