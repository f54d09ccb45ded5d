"""The topology file of `jaxserve launch`: which workers to place, and the router over them.

```yaml
model: tiny-random                 # every worker's --model
placement: PACK                    # Ray placement group strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)
router: {host: 127.0.0.1, port: 8000, args: ["--health-check-interval", "1"]}
kv_pool: {port: 50051}             # optional: a Mooncake Store master beside the router, every worker on it
workers:
  - {role: both, count: 2, tp: 1, cpus: 1, gpus: 0, args: ["--max-num-seqs", "8"]}
  - {role: prefill, count: 1, tp: 2, gpus: 2, ports: [9000]}
```

Parsed and checked here without Ray, so that a bad file fails before anything starts, with an
error that names the bad key (`workers[1].tp: ...`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from server.cluster.worker.cli import ROLES

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Flags the launcher writes itself, from the topology's own keys and the placement.
WORKER_OWN_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--role",
    "--tensor-parallel-size",
    "--kv-pool",
    "--kv-pool-local-host",
)
ROUTER_OWN_FLAGS = ("--host", "--port", "--worker", "--prefill-worker", "--decode-worker")
ROUTER_FLAG_OF_ROLE = {"both": "--worker", "prefill": "--prefill-worker", "decode": "--decode-worker"}


class TopologyError(ValueError):
    """A topology file that cannot be launched; the message names the key."""


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    host: str = "127.0.0.1"
    port: int = 8000
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """The shared KV pool's master (`mooncake_master`), started on the launcher's node; 0: a free port."""

    port: int = 0


@dataclasses.dataclass(frozen=True)
class WorkerGroup:
    """`count` identical workers. `gpus` (0, or a multiple of `tp`) goes into each worker's Ray
    bundle, so Ray picks the devices and sets CUDA_VISIBLE_DEVICES; `ports` (one per worker)
    fixes their gRPC ports, else each worker takes a free port of its node."""

    role: str = "both"
    count: int = 1
    tp: int = 1
    cpus: float = 1.0
    gpus: int = 0
    ports: tuple[int, ...] | None = None
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker to place: its Ray bundle and its `jaxserve worker` flags (all but --host,
    which is its node's address, known only once Ray has placed it)."""

    name: str
    role: str
    bundle: dict[str, float]
    flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Topology:
    model: str
    router: RouterSpec
    workers: tuple[WorkerGroup, ...]
    placement: str = "PACK"
    kv_pool: PoolSpec | None = None

    def worker_specs(self) -> list[WorkerSpec]:
        specs = []
        for group in self.workers:
            for k in range(group.count):
                bundle = {"CPU": group.cpus, **({"GPU": group.gpus} if group.gpus else {})}
                port = group.ports[k] if group.ports else 0  # 0: the worker binds a free port and prints it
                flags = (
                    "--model",
                    self.model,
                    "--port",
                    str(port),
                    "--role",
                    group.role,
                    "--tensor-parallel-size",
                    str(group.tp),
                    *group.args,
                )
                specs.append(WorkerSpec(f"worker-{len(specs)}", group.role, bundle, flags))
        return specs


def load_topology(path: str | Path) -> Topology:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TopologyError(f"cannot read the topology file {path}: {e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TopologyError(f"{path} is not valid YAML: {e}") from e
    return parse_topology(data)


def parse_topology(data: Any) -> Topology:
    top = _mapping(data, "the topology", ("model", "placement", "router", "workers", "kv_pool"))
    model = top.get("model")
    if not isinstance(model, str) or not model:
        raise TopologyError("model: a model name or path is required (what `jaxserve worker --model` takes)")
    placement = top.get("placement", "PACK")
    if placement not in PLACEMENTS:
        raise TopologyError(f"placement: one of {', '.join(PLACEMENTS)}, got {placement!r}")
    router = _router(top.get("router", {}))
    raw_workers = top.get("workers")
    if not isinstance(raw_workers, list) or not raw_workers:
        raise TopologyError("workers: a non-empty list of worker groups is required")
    workers = tuple(_worker_group(w, f"workers[{i}]") for i, w in enumerate(raw_workers))
    roles = {w.role for w in workers}
    if not roles & {"both", "decode"}:
        raise TopologyError("workers: at least one worker of role both or decode is needed (they generate)")
    if "prefill" in roles and "decode" not in roles:
        raise TopologyError("workers: role prefill needs workers of role decode to hand its requests to")
    pool = None
    if "kv_pool" in top:
        raw = _mapping(top["kv_pool"] if top["kv_pool"] is not None else {}, "kv_pool", ("port",))
        port = raw.get("port", 0)
        if not _is_int(port) or not 0 <= port < 65536:
            raise TopologyError(f"kv_pool.port: a port in [0, 65535] (0: a free one), got {port!r}")
        pool = PoolSpec(port)
    return Topology(model, router, workers, placement, pool)


def _router(data: Any) -> RouterSpec:
    router = _mapping(data, "router", ("host", "port", "args"))
    host = router.get("host", RouterSpec.host)
    if not isinstance(host, str) or not host:
        raise TopologyError(f"router.host: an address to listen on, got {host!r}")
    port = router.get("port", RouterSpec.port)
    if not _is_int(port) or not 0 < port < 65536:
        raise TopologyError(f"router.port: a port in [1, 65535], got {port!r}")
    return RouterSpec(host, port, _args(router.get("args", []), "router.args", ROUTER_OWN_FLAGS))


def _worker_group(data: Any, where: str) -> WorkerGroup:
    group = _mapping(data, where, tuple(f.name for f in dataclasses.fields(WorkerGroup)))
    role = group.get("role", "both")
    if role not in ROLES:
        raise TopologyError(f"{where}.role: one of {', '.join(ROLES)}, got {role!r}")
    count = _positive_int(group.get("count", 1), f"{where}.count")
    tp = _positive_int(group.get("tp", 1), f"{where}.tp")
    cpus = group.get("cpus", 1.0)
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
        raise TopologyError(f"{where}.cpus: a number >= 0 (CPUs reserved per worker), got {cpus!r}")
    gpus = group.get("gpus", 0)
    if not _is_int(gpus) or gpus < 0 or gpus % tp:
        raise TopologyError(f"{where}.gpus: 0 or a multiple of tp ({tp}) (GPUs per worker), got {gpus!r}")
    ports = group.get("ports")
    if ports is not None:
        if not isinstance(ports, list) or len(ports) != count or not all(_is_int(p) and 0 < p < 65536 for p in ports):
            raise TopologyError(f"{where}.ports: a list of {count} ports (one per worker) in [1, 65535], got {ports!r}")
        ports = tuple(ports)
    args = _args(group.get("args", []), f"{where}.args", WORKER_OWN_FLAGS)
    return WorkerGroup(role, count, tp, float(cpus), gpus, ports, args)


def _mapping(data: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: a mapping is expected, got {type(data).__name__}")
    for key in data:
        if key not in known:
            raise TopologyError(f"{where}: unknown key {key!r} (known: {', '.join(known)})")
    return data


def _args(data: Any, where: str, own_flags: tuple[str, ...]) -> tuple[str, ...]:
    """Command-line words: strings, or numbers written without quotes."""
    if not isinstance(data, list) or not all(
        isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in data
    ):
        raise TopologyError(f"{where}: a list of command-line words (strings or numbers), got {data!r}")
    args = tuple(str(a) for a in data)
    for arg in args:
        if arg.split("=", 1)[0] in own_flags:
            raise TopologyError(f"{where}: {arg.split('=', 1)[0]} is set by the launcher from the topology")
    return args


def _positive_int(value: Any, where: str) -> int:
    if not _is_int(value) or value < 1:
        raise TopologyError(f"{where}: a positive integer, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
