"""`jaxserve launch --config topology.yaml`: the router and its workers placed on a Ray cluster.

One placement group holds one bundle per worker (its CPUs and GPUs, `placement` as the strategy),
so Ray picks each worker's node and devices; each worker runs as `jaxserve worker` under an actor
in its bundle, listening on its node's address at a port fixed before it starts. The router runs on
the launching node (it holds the public port) once every worker serves, wired to them by role. The
launcher then waits: on SIGINT/SIGTERM it stops the router, then the workers (each SIGTERM, a clean
drain), and frees the placement group. A worker process that exits takes its actor with it, and Ray
restarts the actor (up to --worker-restarts times), which starts the worker again on the same port:
the router marks it down, serves from the others, and takes it back once it serves again.

Which cluster (`ray_cluster`): without --address (or RAY_ADDRESS), a local one of the launcher's
own, bound to --node-ip-address (loopback by default); a named one must answer within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading

from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing
from server.cluster.launch.ray_cluster import ClusterNotFoundError, LocalCluster, check_reachable, choose_cluster
from server.cluster.launch.topology import ROUTER_FLAG_OF_ROLE, Topology, TopologyError, WorkerSpec, load_topology
from server.cluster.pool_tls import ForwarderProcess, cluster_tls_of_flags

WORKER_READY = r"worker listening on (\S+)"
ROUTER_READY = r"Running on (http://\S+)"


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch", help="place a router and its workers on a Ray cluster (pip install 'jaxserve[ray]')"
    )
    p.add_argument("--config", required=True, help="the topology file (YAML): model, router, worker groups")
    p.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (HOST:PORT of its head; 'auto': RAY_ADDRESS, else the last `ray start` here); "
        "default: RAY_ADDRESS, else a local cluster of this launch's own",
    )
    p.add_argument(
        "--node-ip-address",
        default="127.0.0.1",
        help="without --address: the address the local cluster (and so the workers) binds to",
    )
    p.add_argument(
        "--worker-restarts",
        type=int,
        default=3,
        help="times Ray restarts each worker whose process exits (0: a worker that exits stays down)",
    )
    p.add_argument(
        "--placement-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the cluster to have room for every worker's bundle",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="seconds a worker (load and warm-up) or the router may take to serve",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=60.0,
        help="seconds each process gets to drain on stop before it is killed",
    )
    p.set_defaults(func=run_launch)
    return p


def run_launch(args: argparse.Namespace) -> int:
    try:
        topology = load_topology(args.config)
    except TopologyError as e:
        raise SystemExit(f"jaxserve launch: {e}") from None
    try:
        import ray
    except ImportError:
        raise SystemExit("jaxserve launch needs Ray: pip install 'jaxserve[ray]'") from None

    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set() or launch.router is None:  # still starting: give up the start
            raise KeyboardInterrupt
        stop.set()

    if args.worker_restarts < 0:
        raise SystemExit("jaxserve launch: --worker-restarts must be >= 0")
    launch = Launch(topology, args)
    with contextlib.ExitStack() as cluster:
        try:
            target = choose_cluster(args.address)
            check_reachable(target)
            if target.address is None:
                print(f"[launch] starting a local Ray cluster on {args.node_ip_address}", flush=True)
                address = cluster.enter_context(LocalCluster(args.node_ip_address)).address
                launch.local_host = args.node_ip_address  # one node: the workers listen there too
            else:
                address = target.address
                print(f"[launch] joining the Ray cluster at {address} (from {target.source})", flush=True)
        except ClusterNotFoundError as e:
            raise SystemExit(f"jaxserve launch: {e}") from None
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
            signal.signal(sig, on_signal)
        try:
            launch.start()
            return launch.watch(stop)
        except KeyboardInterrupt:
            print("[launch] interrupted while starting", flush=True)
            return 130
        finally:
            launch.stop()
            ray.shutdown()


class Launch:
    """The placement group and the actors of one `jaxserve launch`, in start order."""

    def __init__(self, topology: Topology, args: argparse.Namespace) -> None:
        self.topology = topology
        self.args = args
        self.placement_group = None
        self.workers: list = []  # ManagedProcess actors, in topology order
        self.pids: list[int | None] = []  # each worker's process, as last seen (None: down)
        self.router = None
        self.router_url = ""
        self.local_host: str | None = None  # the launch's own one-node cluster: where workers listen
        self.pool_master: PoolMaster | None = None  # the KV pool's master (topology kv_pool), on this node
        self.pool_gateway: ForwarderProcess | None = None  # its mutual-TLS front, when the workers use TLS

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from server.cluster.launch.managed_process import ManagedProcess, node_and_port

        actor = ray.remote(ManagedProcess)
        specs = self.topology.worker_specs()
        self.pids = [None] * len(specs)
        self.placement_group = placement_group([s.bundle for s in specs], strategy=self.topology.placement)
        try:
            ray.get(self.placement_group.ready(), timeout=self.args.placement_timeout)
        except ray.exceptions.GetTimeoutError:
            raise SystemExit(
                f"jaxserve launch: the cluster has no room for {len(specs)} worker bundles "
                f"{[s.bundle for s in specs]} ({self.topology.placement}) after "
                f"{self.args.placement_timeout:.0f} s; it has {ray.cluster_resources()}"
            ) from None
        strategies = [
            PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i)
            for i in range(len(specs))
        ]
        resources = [dict(num_cpus=s.bundle["CPU"], num_gpus=s.bundle.get("GPU", 0)) for s in specs]
        # Each bundle's node, and a free port there for a worker the topology gives none: a worker
        # that Ray restarts must come back where the router looks for it.
        probe = ray.remote(node_and_port)
        places = ray.get([probe.options(scheduling_strategy=st, **r).remote() for st, r in zip(strategies, resources)])
        if self.local_host is not None:  # (Ray reports the node's outward address even then)
            places = [(self.local_host, port) for _, port in places]
        hosts = [host for host, _ in places]
        pool_flags = self._start_pool()
        print(f"[launch] placing {len(specs)} workers of {self.topology.model} on {', '.join(hosts)}", flush=True)
        for spec, strategy, res, (host, port) in zip(specs, strategies, resources, places):
            argv = _worker_argv(spec, host, port) + ([*pool_flags, "--kv-pool-local-host", host] if pool_flags else [])
            self.workers.append(
                actor.options(
                    name=None,
                    scheduling_strategy=strategy,
                    max_restarts=self.args.worker_restarts,
                    **res,
                ).remote(spec.name, argv, WORKER_READY, exit_with_child=True)
            )
        addresses = self._wait_all([w.wait_ready.remote(self.args.ready_timeout) for w in self.workers])
        self.pids = ray.get([w.pid.remote() for w in self.workers])
        router_flags = [
            arg for spec, address in zip(specs, addresses) for arg in (ROUTER_FLAG_OF_ROLE[spec.role], address)
        ]
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        r = self.topology.router
        self.router = actor.options(num_cpus=0, scheduling_strategy=here).remote(
            "router", ["router", "--host", r.host, "--port", str(r.port), *router_flags, *r.args], ROUTER_READY
        )
        (self.router_url,) = self._wait_all([self.router.wait_ready.remote(self.args.ready_timeout)])
        print(
            f"[launch] router on {self.router_url} over {len(specs)} workers: "
            + ", ".join(f"{s.name} ({s.role}) {a}" for s, a in zip(specs, addresses)),
            flush=True,
        )

    def _start_pool(self) -> list[str]:
        """The KV pool's master on this node when the topology asks for one; the workers' flags for it."""
        if self.topology.kv_pool is None:
            return []
        import ray

        if (why := mooncake_missing()) is not None:
            raise SystemExit(f"jaxserve launch: the topology's kv_pool needs Mooncake Store: {why}")
        host = self.local_host or ray.util.get_node_ip_address()
        port = self.topology.kv_pool.port or None
        tls = cluster_tls_of_flags(self.topology.worker_specs()[0].flags)
        if tls is None:
            self.pool_master = PoolMaster(host, port)
            self.pool_master.start()
            url = self.pool_master.url
        else:  # the workers are on mutual TLS: so is the master's RPC, through a gateway in front of it
            self.pool_master = PoolMaster("127.0.0.1")
            self.pool_master.start()
            self.pool_gateway = ForwarderProcess(
                "accept", f"{host}:{port or 0}", f"127.0.0.1:{self.pool_master.rpc_port}", tls
            )
            url = f"mooncake://{self.pool_gateway.address}"
        print(f"[launch] KV pool master on {url}" + (" (mutual TLS)" if tls else ""), flush=True)
        return ["--kv-pool", url]

    def _wait_all(self, refs: list) -> list[str]:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise SystemExit(f"jaxserve launch: {e.cause}") from None
        except ray.exceptions.RayActorError as e:
            raise SystemExit(f"jaxserve launch: a process died while starting: {e}") from None

    def watch(self, stop: threading.Event) -> int:
        """Until a signal (0) or the router's exit (1); a worker going down, coming back (restarted
        by Ray) or staying down (its restarts used up) is reported once each time."""
        import ray

        while not stop.wait(1.0):
            code = ray.get(self.router.returncode.remote())
            if code is not None:
                print(f"[launch] the router exited with status {code}; stopping the workers", flush=True)
                return 1
            for i, worker in enumerate(self.workers):
                self._check_worker(i, worker)
        return 0

    def _check_worker(self, i: int, worker: object) -> None:
        import ray

        name, was = f"worker-{i}", self.pids[i]
        try:
            pid = ray.get(worker.pid.remote(), timeout=5)
        except ray.exceptions.ActorDiedError:
            if was != -1:
                print(
                    f"[launch] {name} is down for good ({self.args.worker_restarts} restarts used); "
                    "the router serves from the others",
                    flush=True,
                )
                self.pids[i] = -1
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pid = None  # Ray is restarting it
        if pid == was:
            return
        if pid is None:
            print(f"[launch] {name} exited; Ray restarts it, the router serves from the others meanwhile", flush=True)
        else:
            print(f"[launch] {name} restarted (pid {pid}); the router takes it back once it serves", flush=True)
        self.pids[i] = pid

    def stop(self) -> None:
        """The router first (no new requests reach a stopping worker), then the workers together."""
        import ray
        from ray.util.placement_group import remove_placement_group

        timeout = self.args.stop_timeout
        for group in ([self.router] if self.router else [], self.workers):
            try:
                ray.get([p.stop.remote(timeout) for p in group], timeout=timeout + 30)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                print(f"[launch] stopping: {e}", flush=True)
        for p in [self.router, *self.workers]:
            if p is not None:
                ray.kill(p)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        if self.pool_gateway is not None:
            self.pool_gateway.close()
        if self.pool_master is not None:
            self.pool_master.kill()
        print("[launch] stopped", flush=True)


def _worker_argv(spec: WorkerSpec, host: str, port: int) -> list[str]:
    """`jaxserve worker` on `host`, at the topology's port or else `port`."""
    flags = list(spec.flags)
    at = flags.index("--port") + 1
    if flags[at] == "0":
        flags[at] = str(port)
    return ["worker", "--host", host, *flags]
