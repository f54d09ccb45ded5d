"""`jaxserve worker`: one engine process serving the internal `Worker` gRPC service.

Load, compile every bucket, then serve on --host:--port until SIGTERM/SIGINT, when calls in
flight get --shutdown-timeout seconds to finish. A router (`jaxserve router --worker HOST:PORT`)
does tokenization, sessions, keys and limits; this process only runs the engine. With --role
prefill or decode it is one side of prefill/decode disaggregation (`jaxserve router
--prefill-worker ... --decode-worker ...`): a prefill worker holds a prompt's KV blocks under a
lease for --kv-lease-timeout seconds, a decode worker pulls them from it: as bytes over gRPC, or
device to device (`jax.experimental.transfer`) where both run with --kv-transport device.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from server.cli import StartEngine
from server.tls import ClusterTLS, add_cluster_tls_args, cluster_tls_from_args

ROLES = ("both", "prefill", "decode")
TRANSPORTS = ("grpc", "device")


def add_worker_parser(
    subparsers: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    start_engine: Callable[[argparse.Namespace], StartEngine],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser("worker", help="an engine process behind the internal gRPC service of a router")
    add_engine_args(p)
    g = p.add_argument_group("worker")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (keep it on a private network)")
    g.add_argument("--port", type=int, required=True)
    g.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="prefill: runs prompts and leases their KV blocks to decode workers; decode: pulls "
        "them and generates; both: either, or whole requests",
    )
    g.add_argument(
        "--kv-lease-timeout",
        type=float,
        default=30.0,
        help="seconds a prefill worker holds a prompt's KV blocks for a decode worker that does not pull them",
    )
    g.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default="grpc",
        help="how KV blocks move between prefill and decode workers: grpc (bytes over the worker "
        "service) or device (device to device through jax.experimental.transfer, on a transfer "
        "server listening on --host; used where both workers have it, else grpc)",
    )
    g.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight calls get to finish on SIGTERM/SIGINT"
    )
    add_cluster_tls_args(p.add_argument_group("cluster TLS (the router's and other workers' calls)"))
    p.set_defaults(kv_events=True)  # a worker records them for its router (--no-kv-events: not)
    p.set_defaults(func=lambda args: run_worker(args, start_engine(args)))
    return p


def run_worker(args: argparse.Namespace, start_engine: StartEngine) -> int:
    if args.kv_lease_timeout <= 0:
        raise SystemExit("--kv-lease-timeout must be positive")
    one_replica = args.data_parallel_size == 1
    if args.role != "both" and not one_replica:
        raise SystemExit(
            f"--role {args.role} runs one engine replica in one process (no --data-parallel-size, no multi-host)"
        )
    if args.kv_transport == "device" and not one_replica:
        raise SystemExit("--kv-transport device runs one engine replica in one process")
    tls = cluster_tls_from_args(args)  # before the model loads: a wrong file stops us now
    pool_forwarder = None
    if tls is not None and args.kv_pool:  # the pool's master RPC over mutual TLS too
        from server.cluster.pool_tls import pool_url_over_tls

        try:
            args.kv_pool, pool_forwarder = pool_url_over_tls(args.kv_pool, tls)
        except (RuntimeError, ValueError) as e:
            raise SystemExit(str(e)) from None
    try:
        return _serve_worker(args, start_engine, tls)
    finally:
        if pool_forwarder is not None:
            pool_forwarder.close()


def _serve_worker(args: argparse.Namespace, start_engine: StartEngine, tls: ClusterTLS | None) -> int:
    import asyncio
    import signal

    from server.cluster.worker.kv_handoff import KVHandoff
    from server.cluster.worker.listener import WorkerListener

    one_replica = args.data_parallel_size == 1
    engine = start_engine(kv_transfer_host=args.host if args.kv_transport == "device" else None)
    if engine is None:
        return 0
    if engine.info.encoder is not None and args.role != "both":
        raise SystemExit(f"--role {args.role}: an encoder embedding model has no KV cache to hand off")
    has_kv = one_replica and engine.info.encoder is None
    handoff = KVHandoff(engine, args.kv_lease_timeout, tls) if has_kv else None

    async def serve() -> None:
        listener = WorkerListener(engine, args.host, args.port, args.role, handoff, tls)
        await listener.start()
        print(f"worker listening on {listener.address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a dead engine loop sends SIGTERM too
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await listener.stop(args.shutdown_timeout)

    try:
        asyncio.run(serve())
    finally:
        asyncio.run(engine.aclose())
    if engine.fatal_error is not None:
        print(f"worker stopped: the engine failed ({engine.fatal_error!r})", flush=True)
        return 1
    print("worker stopped", flush=True)
    return 0
