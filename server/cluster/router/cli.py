"""`jaxserve router`: the public API of `jaxserve serve` over remote workers.

The router loads no model: it waits for a worker to answer, takes the tokenizer and limits
from it, and serves HTTP (and gRPC with --grpc-port) with the server's routes, sessions, keys
and limits over a `RemoteEngine`. Workers that are down at start join when they answer. With
--prefill-worker and --decode-worker it disaggregates: prompts are prefilled on the former, whose
KV blocks the latter pull before they decode.
"""

from __future__ import annotations

import argparse

from jaxserve.placement import PlacementPolicy
from server.cli import add_server_args, run_app, server_config_from_args
from server.cluster import host_port
from server.tls import add_cluster_tls_args, cluster_tls_from_args

DEFAULTS = PlacementPolicy()  # SGLang's router's


def add_router_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="the OpenAI server over remote workers (jaxserve worker)")
    g = p.add_argument_group("workers")
    g.add_argument(
        "--worker",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a colocated worker's address (--role both; repeatable)",
    )
    g.add_argument(
        "--prefill-worker",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a prefill worker (jaxserve worker --role prefill; repeatable): prompts run there and "
        "their KV blocks move to a decode worker",
    )
    g.add_argument(
        "--decode-worker",
        type=host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a decode worker (jaxserve worker --role decode; repeatable): pulls a prompt's KV blocks "
        "from the prefill worker and generates to the end",
    )
    _add_placement_args(p.add_argument_group("placement"))
    g.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between worker health checks")
    g.add_argument(
        "--worker-wait-timeout", type=float, default=600.0, help="seconds to wait at start for a worker to serve"
    )
    add_cluster_tls_args(g)
    add_server_args(p.add_argument_group("server"))
    p.set_defaults(func=run_router)
    return p


def _add_placement_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=DEFAULTS.match_fraction,
        help="share of a prompt a worker's cached prefix must cover to attract it",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=DEFAULTS.balance_abs,
        help="route by load alone when the busiest worker runs this many more sequences than the idlest...",
    )
    g.add_argument(
        "--balance-rel-threshold", type=float, default=DEFAULTS.balance_rel, help="...and this many times as many"
    )
    g.add_argument(
        "--worker-max-loras",
        type=int,
        default=DEFAULTS.lora_slots,
        help="the workers' --max-loras: a worker counts as holding the LoRA adapters of the last "
        "requests sent to it, this many distinct ones, and attracts their requests",
    )
    g.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.kv_events,
        help="place by the workers' KV events (what their prefix caches hold) as well as by what was sent to each; "
        "--no-kv-events: by what was sent alone",
    )


def run_router(args: argparse.Namespace) -> int:
    from aiohttp import web

    from server.app import build_app
    from server.cluster.router.remote_engine import RemoteEngine

    if not args.worker and not args.decode_worker:
        raise SystemExit("give --worker or --decode-worker (a router needs workers that generate)")
    if args.prefill_worker and not args.decode_worker:
        raise SystemExit("--prefill-worker needs --decode-worker")
    if not 0.0 <= args.cache_threshold <= 1.0:
        raise SystemExit(f"--cache-threshold must be in [0, 1], got {args.cache_threshold}")
    if args.balance_abs_threshold < 0 or args.balance_rel_threshold < 1.0:
        raise SystemExit("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
    if args.worker_max_loras < 1:
        raise SystemExit("--worker-max-loras must be >= 1")
    if args.health_check_interval <= 0:
        raise SystemExit("--health-check-interval must be positive")
    policy = PlacementPolicy(
        args.cache_threshold,
        args.balance_abs_threshold,
        args.balance_rel_threshold,
        args.worker_max_loras,
        kv_events=args.kv_events,
    )
    tls = cluster_tls_from_args(args)
    front_config = server_config_from_args(args, "router")  # its host and port (the app's names the model)

    async def make_app() -> web.Application:
        everyone = args.worker + args.decode_worker + args.prefill_worker
        print(f"waiting for workers: {', '.join(everyone)}", flush=True)
        remote = await RemoteEngine.connect(
            args.worker,
            policy,
            args.health_check_interval,
            args.worker_wait_timeout,
            args.decode_worker,
            args.prefill_worker,
            tls,
        )
        up = sum(w.up for w in remote.workers + remote.prefill_workers)
        print(f"{up} of {len(everyone)} workers serve {remote.info.model_name}", flush=True)
        config = server_config_from_args(args, remote.info.model_name)
        app = build_app(remote, config)
        if config.grpc_port:
            from server.grpc_api.server import GrpcServer

            GrpcServer(config.host, config.grpc_port).attach(app)

        async def close(_app: web.Application) -> None:
            await remote.aclose()

        app.on_cleanup.append(close)
        return app

    run_app(make_app(), front_config)
    print("router stopped", flush=True)
    return 0
