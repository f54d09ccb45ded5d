"""Result files and tables: every benchmark writes one JSON of the same shape, printed the same way.

    {"kind": "serve" | "throughput" | "latency" | "sweep", "system": {...}, "model": ..., "dtype": ...,
     "config": {...}, "workload": {...}, "backends": {"jaxserve": {"results": {...}, "kv_tiers": {...}, ...},
                                                       PEER: {...}},
     "ratios": {PEER: {key: jaxserve / PEER}}}

A ratio is always jaxserve's figure over the peer's; the table says for each row whether that is
better or worse (higher is better for throughputs, lower for times).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

OURS = "jaxserve"


def higher_is_better(key: str) -> bool | None:
    """True for rates, False for times, None for plain counts (no judgement)."""
    if "throughput" in key or "goodput" in key or key.endswith("_per_s") or key == "slo_attainment":
        return True
    if key.endswith(("_ms", "_s", "_seconds")) or "_ms_per_" in key:
        return False
    return None


def ratios(ours: Mapping[str, Any], peer: Mapping[str, Any]) -> dict[str, float]:
    """ours / peer for every numeric key both have (and the peer's value is non-zero)."""
    out = {}
    for key, value in ours.items():
        other = peer.get(key)
        if _is_number(value) and _is_number(other) and other != 0:
            out[key] = value / other
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.3g}"


def _verdict(key: str, ratio: float) -> str:
    sense = higher_is_better(key)
    if sense is None or ratio <= 0:
        return ""
    factor = ratio if sense else 1 / ratio
    return f"{factor:.2f}x better" if factor >= 1 else f"{1 / factor:.2f}x worse"


def table(title: str, columns: Mapping[str, Mapping[str, Any]], keys: Iterable[str] | None = None) -> str:
    """Rows = metric keys, one column per backend; with exactly two backends, a ratio column too."""
    names = list(columns)
    keys = (
        list(keys) if keys is not None else [k for k, v in columns[names[0]].items() if not isinstance(v, (dict, list))]
    )
    header = ["metric", *names]
    two = len(names) == 2
    if two:
        header += [f"{names[0]}/{names[1]}", ""]
    rows = []
    for key in keys:
        values = [columns[n].get(key) for n in names]
        row = [key, *(_fmt(v) for v in values)]
        if two:
            r = values[0] / values[1] if _is_number(values[0]) and _is_number(values[1]) and values[1] else None
            row += [_fmt(r), _verdict(key, r) if r is not None else ""]
        rows.append(row)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    bar = "=" * (sum(widths) + 2 * (len(widths) - 1))
    out = [bar, title.center(len(bar)), bar, line.format(*header), "-" * len(bar)]
    out += [line.format(*row) for row in rows]
    out.append(bar)
    return "\n".join(out)


def print_result(result: Mapping[str, Any], keys: Iterable[str] | None = None) -> None:
    """One table per peer (jaxserve vs peer with ratios), or jaxserve alone."""
    backends = result["backends"]
    title = f"{result['kind']} benchmark: {result['model']} ({result['workload'].get('name', '')})"
    keys = list(keys) if keys is not None else None
    peers = [name for name in backends if name != OURS]
    if not peers:
        print(table(title, {OURS: backends[OURS]["results"]}, keys))
    for peer in peers:
        print(table(f"{title} vs {peer}", {OURS: backends[OURS]["results"], peer: backends[peer]["results"]}, keys))
    for name, backend in backends.items():
        for group, metrics in (backend.get("groups") or {}).items():
            print(table(f"{name}, group {group!r}", {name: metrics}, keys))
        if backend.get("kv_tiers"):
            print(table(f"{name}, KV tiers", {name: backend["kv_tiers"]}))
        if backend.get("speculative"):
            print(table(f"{name}, speculative decoding", {name: backend["speculative"]}))


def with_ratios(result: dict[str, Any]) -> dict[str, Any]:
    ours = result["backends"][OURS]["results"]
    result["ratios"] = {name: ratios(ours, b["results"]) for name, b in result["backends"].items() if name != OURS}
    return result


def write_json(result: Mapping[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str))


def compare(path_a: str | Path, path_b: str | Path) -> str:
    """Side by side: each backend's results in A and in B, with A / B, and what differs in setup."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    lines = []
    for field in ("kind", "model", "dtype"):
        if a.get(field) != b.get(field):
            lines.append(f"note: {field} differs: {a.get(field)!r} vs {b.get(field)!r}")
    for field in ("config", "workload", "run"):
        if a.get(field) != b.get(field):
            lines.append(f"note: {field} differs")
    sys_a, sys_b = a.get("system", {}), b.get("system", {})
    for field in ("cpu", "cpus_usable", "gpus", "versions"):
        if sys_a.get(field) != sys_b.get(field):
            lines.append(f"note: system {field} differs: {sys_a.get(field)} vs {sys_b.get(field)}")
    lines.append(f"A = {path_a}\nB = {path_b}")
    for name in [n for n in a["backends"] if n in b["backends"]]:
        columns = {"A": a["backends"][name]["results"], "B": b["backends"][name]["results"]}
        keys = [k for k, v in columns["A"].items() if _is_number(v) or v is None]
        lines.append(table(f"{name}: A vs B", columns, keys))
    return "\n".join(lines)
