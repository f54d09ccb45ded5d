"""`jaxserve bench sweep`: several request rates (or concurrencies) in one run.

Each backend's server is started once and sent one workload per point; point i uses the
workload built with seed + i, so no point is served from the prefix cache another point filled.
Results: the latency-throughput curve, and the highest rate (or concurrency) whose SLO attainment
(fraction of requests meeting every SLO limit) reaches the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bench.load import LoadSpec
from bench.metrics import SLO
from bench.plots import plot_cdfs, plot_latency_curves
from bench.report import OURS, ratios, table, with_ratios
from bench.serve import RunResult, ServeOptions, check_serving_peer, endpoint_for, measure, server_dtype
from bench.system_info import system_info
from bench.workloads import Workload


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    x: float  # the request rate or the concurrency of this point
    spec: LoadSpec


def best_point(points: list[tuple[float, dict[str, Any]]], target_attainment: float) -> float | None:
    """The largest x whose SLO attainment reaches the target (None if none does)."""
    meeting = [x for x, m in points if (m.get("slo_attainment") or 0.0) >= target_attainment]
    return max(meeting) if meeting else None


def summary(points: list[tuple[float, dict[str, Any]]], target_attainment: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "peak_request_throughput": max(m["request_throughput"] for _, m in points),
        "peak_output_throughput": max(m["output_throughput"] for _, m in points),
    }
    if target_attainment is not None:
        out["max_x_meeting_slo"] = best_point(points, target_attainment)
    return out


def run_sweep(opts: ServeOptions, make_workload: Callable[[int], Workload], points: list[SweepPoint], xlabel: str,
              tokenizer: Any, slo: SLO | None, target_attainment: float, percentiles: tuple[float, ...],
              plot_stem: str | None = None, show_progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every point for jaxserve, then for the peer; `xlabel` names x (request_rate or max_concurrency)."""
    check_serving_peer(opts)
    workloads = [make_workload(i) for i in range(len(points))]
    runs: dict[str, list[RunResult]] = {}
    backends: dict[str, Any] = {}
    for backend in [OURS, *([opts.peer] if opts.peer else [])]:
        with endpoint_for(backend, opts, tokenizer) as (endpoint, info):
            runs[backend] = [
                measure(endpoint, w, p.spec, tokenizer, slo, percentiles, f"{backend} {xlabel}={p.x:g}", show_progress)
                for w, p in zip(workloads, points)
            ]
        curve = [(p.x, r.metrics) for p, r in zip(points, runs[backend])]
        backends[backend] = {
            "results": summary(curve, target_attainment if slo else None),
            "points": [{"x": p.x, "run": p.spec.describe(), **r.to_json()} for p, r in zip(points, runs[backend])],
            "info": info,
        }
    result = {
        "kind": "sweep",
        "system": system_info(include_jax_devices=opts.base_url is None),
        "model": opts.model,
        "dtype": server_dtype(opts.server_args),
        "config": {"server_args": opts.server_args, "base_url": opts.base_url, "peer_threads": opts.peer_threads},
        "workload": workloads[0].describe(),
        "run": {
            "x": xlabel,
            "points": [p.x for p in points],
            "slo": dataclasses.asdict(slo) if slo else None,
            "target_attainment": target_attainment,
            "ignore_eos": opts.ignore_eos,
        },  # fmt: skip
        "backends": backends,
    }
    with_ratios(result)
    result["point_ratios"] = {
        peer: [ratios(a["results"], b["results"]) for a, b in zip(backends[OURS]["points"], backends[peer]["points"])]
        for peer in backends if peer != OURS
    }  # fmt: skip
    if plot_stem:
        title = f"{opts.model}, {workloads[0].name}"
        curves = {b: [(p.x, r.metrics) for p, r in zip(points, rs)] for b, rs in runs.items()}
        paths = [plot_latency_curves(curves, f"{plot_stem}-latency.png", xlabel, title)]
        for i, p in enumerate(points):
            lists = {b: rs[i].latency_lists for b, rs in runs.items()}
            paths.append(plot_cdfs(lists, f"{plot_stem}-cdf-{xlabel}-{p.x:g}.png", f"{title}, {xlabel} {p.x:g}"))
        result["plots"] = [str(p) for p in paths]
    return result


def print_sweep(result: dict[str, Any], keys: list[str]) -> None:
    """Each backend's curve, then jaxserve against each peer point by point, with ratios."""
    xname = result["run"]["x"]
    backends = result["backends"]
    for name, backend in backends.items():
        columns = {f"{xname}={pt['x']:g}": pt["results"] for pt in backend["points"]}
        print(table(f"sweep: {name}", columns, keys))
        print(f"{name}: {backend['results']}")
        tiers = {f"{xname}={pt['x']:g}": pt["kv_tiers"] for pt in backend["points"] if pt.get("kv_tiers")}
        if tiers:
            print(table(f"sweep: {name}, KV tiers", tiers))
    for peer in [n for n in backends if n != OURS]:
        for ours, theirs in zip(backends[OURS]["points"], backends[peer]["points"]):
            columns = {OURS: ours["results"], peer: theirs["results"]}
            print(table(f"{xname}={ours['x']:g}: {OURS} vs {peer}", columns, keys))
