"""Where a request runs: one placement for the in-process data-parallel engine (its targets are
engine replicas, `jaxserve.engine_core.EngineCore`) and the router over worker processes (its
targets are `server.cluster.router.worker_client.WorkerClient`).

`policy.py` is the rule (SGLang's cache-aware routing: longest cached prefix unless loads are far
apart); `placement.py` applies it to targets and keeps sessions on their target; `prefix_tree.py`
and `sent_prefixes.py` are the picture of a target's cache that a placer builds from what it sent
there, for targets it cannot ask (worker processes). No JAX here.
"""

from jaxserve.placement.placement import Placement, PlacementTarget
from jaxserve.placement.policy import PlacementPolicy, choose_target

__all__ = ["Placement", "PlacementPolicy", "PlacementTarget", "choose_target"]
