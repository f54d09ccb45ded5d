"""`jaxserve launch --config topology.yaml`: the router and its workers placed on a Ray cluster.

One placement group holds one bundle per worker (its CPUs and GPUs, `placement` as the strategy),
so Ray picks each worker's node and devices; each worker runs as `jaxserve worker` under an actor
in its bundle, listening on its node's address. The router runs on the launching node (it holds
the public port) once every worker serves, wired to them by role. The launcher then waits: on
SIGINT/SIGTERM it stops the router, then the workers (each SIGTERM, a clean drain), and frees the
placement group. A worker that exits is reported and left down (the router marks it and serves from
the others); restarting processes is the cluster manager's job, not this launcher's.

Without --address, Ray's usual discovery applies (RAY_ADDRESS, a cluster started on this node by
`ray start`), else Ray starts a local cluster for the launcher's lifetime.
"""

from __future__ import annotations

import argparse
import signal
import threading

from server.cluster.launch.topology import ROUTER_FLAG_OF_ROLE, Topology, TopologyError, load_topology

WORKER_READY = r"worker listening on (\S+)"
ROUTER_READY = r"Running on (http://\S+)"


def add_launch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("launch", help="place a router and its workers on a Ray cluster (pip install 'jaxserve[ray]')")
    p.add_argument("--config", required=True, help="the topology file (YAML): model, router, worker groups")
    p.add_argument("--address", default=None,
                   help="the Ray cluster (HOST:PORT of its head, or 'auto'); default: Ray's discovery, else a local cluster")
    p.add_argument("--placement-timeout", type=float, default=60.0,
                   help="seconds to wait for the cluster to have room for every worker's bundle")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds a worker (load and warm-up) or the router may take to serve")
    p.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds each process gets to drain on stop before it is killed")
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

    launch = Launch(topology, args)
    ray.init(address=args.address, log_to_driver=True, configure_logging=False)
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
        self.router = None
        self.router_url = ""

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from server.cluster.launch.managed_process import ManagedProcess

        actor = ray.remote(ManagedProcess)
        specs = self.topology.worker_specs()
        self.placement_group = placement_group([s.bundle for s in specs], strategy=self.topology.placement)
        try:
            ray.get(self.placement_group.ready(), timeout=self.args.placement_timeout)
        except ray.exceptions.GetTimeoutError:
            raise SystemExit(f"jaxserve launch: the cluster has no room for {len(specs)} worker bundles "
                             f"{[s.bundle for s in specs]} ({self.topology.placement}) after "
                             f"{self.args.placement_timeout:.0f} s; it has {ray.cluster_resources()}") from None
        for i, spec in enumerate(specs):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i)
            self.workers.append(actor.options(
                name=None, num_cpus=spec.bundle["CPU"], num_gpus=spec.bundle.get("GPU", 0),
                scheduling_strategy=strategy).remote(spec.name))
        hosts = ray.get([w.node_address.remote() for w in self.workers])
        print(f"[launch] placing {len(specs)} workers of {self.topology.model} on {', '.join(hosts)}", flush=True)
        addresses = self._wait_all([
            w.start.remote(["worker", "--host", host, *spec.flags], WORKER_READY, self.args.ready_timeout)
            for w, host, spec in zip(self.workers, hosts, specs)])
        router_flags = [arg for spec, address in zip(specs, addresses)
                        for arg in (ROUTER_FLAG_OF_ROLE[spec.role], address)]
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.router = actor.options(num_cpus=0, scheduling_strategy=here).remote("router")
        r = self.topology.router
        self.router_url, = self._wait_all([self.router.start.remote(
            ["router", "--host", r.host, "--port", str(r.port), *router_flags, *r.args],
            ROUTER_READY, self.args.ready_timeout)])
        print(f"[launch] router on {self.router_url} over {len(specs)} workers: "
              + ", ".join(f"{s.name} ({s.role}) {a}" for s, a in zip(specs, addresses)), flush=True)

    def _wait_all(self, refs: list) -> list[str]:
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise SystemExit(f"jaxserve launch: {e.cause}") from None

    def watch(self, stop: threading.Event) -> int:
        """Until a signal (0) or the router's exit (1); workers that exit are reported once."""
        import ray

        reported: set[int] = set()
        while not stop.wait(1.0):
            codes = ray.get([w.returncode.remote() for w in self.workers] + [self.router.returncode.remote()])
            if codes[-1] is not None:
                print(f"[launch] the router exited with status {codes[-1]}; stopping the workers", flush=True)
                return 1
            for i, code in enumerate(codes[:-1]):
                if code is not None and i not in reported:
                    reported.add(i)
                    print(f"[launch] worker-{i} exited with status {code}; the router serves from the others",
                          flush=True)
        return 0

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
        print("[launch] stopped", flush=True)
