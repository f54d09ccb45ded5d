"""The engine of a serving process (`jaxserve serve`, `jaxserve worker`): load the model, compile
every bucket, start the engine loop, and say what it did on stdout.

`jaxserve/cli.py` (the composition root) hands `start_engine` to the server's and the worker's
commands, which see only the `EngineClient` it returns.
"""

from __future__ import annotations

import os
import signal
import time

import jax

from jaxserve.async_engine import AsyncEngine
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import make_engine
from sharding import multihost


def start_engine(model: str, config: EngineConfig, kv_transfer_host: str | None = None,
                 lora_modules: dict[str, str] | None = None) -> AsyncEngine | None:
    """The started engine of this process, warmed up.

    A dead engine loop (a device step failed) stops the process like SIGTERM, so a serving
    process exits non-zero and its supervisor restarts it. With `kv_transfer_host` (an address
    other workers reach) the engine serves device-to-device KV pulls there. `lora_modules`: LoRA
    adapters (name -> PEFT directory) served from the start.

    In a multi-process job (one engine whose pp x tp mesh spans every process's devices: tensor
    parallel, or pipeline stages on different hosts), process 0 gets the engine and the others
    replay its device operations here until it stops; they get None.
    """
    if jax.process_count() > 1:
        check_multi_process(config, len(jax.devices()), jax.process_count())
    t0 = time.perf_counter()
    engine = make_engine(model, config)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f} s", flush=True)
    replicas = getattr(engine, "replicas", [engine])
    for name, path in (lora_modules or {}).items():
        try:
            for replica in replicas:
                replica.add_lora(name, path)
        except ValueError as e:
            raise SystemExit(f"--lora-modules {name}={path}: {e}") from None
        print(f"LoRA adapter {name!r} from {path}", flush=True)
    for disk in {id(e.disk_tier): e.disk_tier for e in replicas if e.disk_tier is not None}.values():
        print(f"KV disk tier in {disk.root}: {disk.num_files} blocks found ({disk.num_bytes / 1e6:.1f} MB)", flush=True)
    on_each = f" on each of {len(replicas)} replicas" if len(replicas) > 1 else ""
    print(f"compiling buckets{on_each}: {replicas[0].runner.bucket_summary()}", flush=True)
    seconds = engine.warm_up()
    print(f"warm-up: {engine.num_compilations} compilations in {seconds:.1f} s", flush=True)
    async_engine = AsyncEngine(engine)
    if jax.process_count() > 1:
        multihost.barrier("jaxserve-serve-warm")
        channel = multihost.StepChannel()
        runner = async_engine.engine.lone_replica.runner
        if jax.process_index() != 0:
            count = multihost.follow(runner, channel)
            print(f"process {jax.process_index()}: replayed {count} device operations; process 0 stopped", flush=True)
            return None
        leader = multihost.Leader(runner, channel)
        async_engine.on_idle = leader.keep_alive
        async_engine.on_stopped = leader.stop
    if kv_transfer_host is not None:
        print(f"KV transfer server on {async_engine.start_transfer_server(kv_transfer_host)}", flush=True)
    async_engine.on_fatal = lambda _error: os.kill(os.getpid(), signal.SIGTERM)
    async_engine.start()
    return async_engine


def check_multi_process(config: EngineConfig, devices: int, processes: int) -> None:
    """SystemExit, saying what to do instead, unless `config` is one engine over all `devices` of a
    job of `processes` processes (the only multi-process layout: process 0 runs the engine and the
    others replay its device operations, so no process can run a replica of its own)."""
    if config.data_parallel_size > 1:
        raise SystemExit(
            f"--data-parallel-size {config.data_parallel_size} does not span processes: a multi-process job runs "
            f"one engine (process 0 schedules it, the others replay its steps), so a replica cannot run on another "
            f"process's devices. For data-parallel replicas on several processes or hosts, start one "
            f"`jaxserve worker` per process and `jaxserve router --worker HOST:PORT --worker HOST:PORT` over them "
            f"(or `jaxserve launch`); the router routes by prefix cache and load, as --data-parallel-size does")
    spanned = config.tensor_parallel_size * config.pipeline_parallel_size * config.expert_parallel_size
    if spanned != devices:
        raise SystemExit(f"a multi-process job runs one engine over all {devices} devices of its {processes} "
                         f"processes: use --tensor-parallel-size x --pipeline-parallel-size = {devices} "
                         f"(e.g. --tensor-parallel-size {devices}) and --data-parallel-size 1")
