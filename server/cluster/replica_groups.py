"""`jaxserve serve` with data-parallel replicas on several processes (`--data-parallel-size` with
`--num-processes`).

The job's processes form replica groups (`sharding.process_layout`): a process holding whole
replicas, or consecutive processes sharing one. Each group's leader serves its engine as a worker
(the `Worker` gRPC service, on this host's address on the route to the coordinator, a free port)
and publishes the address through the job's coordination service. Process 0 also serves the
public API over every group's worker with the router (`RemoteEngine`): the same placement by
prefix cache and load, and the same failover, as `jaxserve router` over `jaxserve worker`s. When
process 0 stops it tells the other groups to stop; a group that stops alone is a worker gone,
and the router routes around it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from typing import NoReturn

import jax

from jaxserve.engine_client import EngineClient
from server.cli import StartEngine, run_app, server_config_from_args
from server.cluster.worker.listener import WorkerListener
from sharding import multihost
from sharding.process_layout import ProcessLayout

STOP_KEY = "jaxserve/serve/stop"
GROUP_WAIT_S = 1800.0  # a group's load and warm-up may take this long (as the warm-up barrier allows)


def group_address_key(group: int) -> str:
    return f"jaxserve/serve/group/{group}"


def serve_replica_groups(args: argparse.Namespace, start_engine: StartEngine) -> int:
    """Run this process's part of the job: 0 after a graceful stop, 1 when its engine failed."""
    engine = start_engine()  # (SystemExit where the processes' devices cannot hold the replicas)
    if engine is None:  # a follower: it replayed its leader's steps until the leader stopped
        _leave(0)
    per_replica = args.tensor_parallel_size * args.pipeline_parallel_size * args.expert_parallel_size
    layout = multihost.job_layout(args.data_parallel_size, per_replica)
    listener = WorkerListener(engine, multihost.reachable_address(), 0)
    try:
        if jax.process_index() == 0:
            run_app(_front_door(args, engine, listener, layout), server_config_from_args(args))
        else:
            asyncio.run(_serve_group(listener, layout, args.shutdown_timeout))
    finally:
        asyncio.run(engine.aclose())
        if jax.process_index() == 0:
            multihost.publish(STOP_KEY, "stop")  # (again: the app may have failed before its cleanup)
    if engine.fatal_error is not None:
        print(f"server stopped: the engine failed ({engine.fatal_error!r})", flush=True)
        code = 1
    else:
        print("server stopped", flush=True)
        code = 0
    if jax.process_index() != 0:
        _leave(code)
    return code


def _leave(code: int) -> NoReturn:
    """End a process other than 0 without `jax.distributed`'s exit-time shutdown: the job's
    coordination service runs in process 0, which may be gone by then (with recoverability on its
    own shutdown does not wait for the others), and a shutdown that cannot reach it aborts the
    process (SIGABRT) instead of exiting with `code`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _front_door(args: argparse.Namespace, engine: EngineClient, listener: WorkerListener, layout: ProcessLayout):
    """Process 0's app: the public API over every group's worker, its own included."""
    from server.app import build_app
    from server.cluster.router.remote_engine import RemoteEngine

    await listener.start()
    multihost.publish(group_address_key(0), listener.address)
    addresses = [listener.address]
    for group in range(1, layout.groups):
        try:
            addresses.append(await asyncio.to_thread(multihost.lookup, group_address_key(group), GROUP_WAIT_S))
        except Exception as e:  # the coordination service's timeout or a process gone
            raise SystemExit(
                f"replica group {group} (processes {list(layout.members(group))}) did not serve "
                f"within {GROUP_WAIT_S:g} s: {e}"
            ) from None
    print(
        f"routing over {layout.groups} replica groups of {layout.replicas_per_group} replica(s) each: "
        f"{', '.join(addresses)}",
        flush=True,
    )
    remote = await RemoteEngine.connect(addresses, timeout=GROUP_WAIT_S)
    config = server_config_from_args(args, remote.info.model_name)
    app = build_app(remote, config)
    if config.grpc_port:
        from server.grpc_api.server import GrpcServer

        GrpcServer(config.host, config.grpc_port).attach(app)

    async def close(_app) -> None:
        await remote.aclose()
        multihost.publish(STOP_KEY, "stop")
        await listener.stop(0)  # the app's drain already gave requests --shutdown-timeout
        await engine.aclose()

    app.on_cleanup.append(close)
    return app


async def _serve_group(listener: WorkerListener, layout: ProcessLayout, shutdown_timeout: float) -> None:
    """Another group's leader: serve its engine as a worker until process 0 stops, or SIGTERM/SIGINT."""
    await listener.start()
    group = layout.group_of(jax.process_index())
    multihost.publish(group_address_key(group), listener.address)
    print(f"replica group {group} serves as a worker on {listener.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a dead engine loop sends SIGTERM too
        loop.add_signal_handler(sig, stop.set)

    def wait_for_process_0() -> None:
        while not stop.is_set():
            try:
                multihost.lookup(STOP_KEY, 60.0)
                break
            except Exception:  # not yet (the lookup timed out), unless the job's coordinator is gone
                if not _coordinator_up():
                    break
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_process_0, name="await-process-0", daemon=True).start()
    await stop.wait()
    await listener.stop(shutdown_timeout)
    snapshot = await listener.engine.snapshot()
    if snapshot is not None:
        print(
            f"replica group {group} stops: {snapshot.prompt_tokens_computed} prompt tokens computed, "
            f"{snapshot.generated_tokens} generated",
            flush=True,
        )


def _coordinator_up() -> bool:
    """Whether the coordination service still answers (process 0 published its address there)."""
    try:
        multihost.lookup(group_address_key(0), 5.0)
        return True
    except Exception:
        return False
