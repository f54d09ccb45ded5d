"""PNG plots of serving results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

PERCENTILE_STYLES = {"median": ("-", "o"), "p90": ("--", "s"), "p99": (":", "^")}
CURVE_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "end-to-end latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(series: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path, title: str = "") -> Path:
    """Empirical CDFs of TTFT and TPOT; `series` maps a backend label to its raw lists in seconds."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (metric, name) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"))):
        for label, lists in series.items():
            values = np.sort(np.asarray(lists.get(metric, []), dtype=float) * 1e3)
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_latency_curves(curves: Mapping[str, Sequence[tuple[float, Mapping[str, float | None]]]], path: str | Path,
                        xlabel: str, title: str = "") -> Path:  # fmt: skip
    """median / p90 / p99 of TTFT, TPOT and E2E latency against x (request rate or concurrency).

    `curves` maps a backend label to its points: (x, metrics dict from `compute_metrics`).
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(15, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, name) in zip(axes, CURVE_METRICS):
        for color, (label, points) in zip(colors, curves.items()):
            points = sorted(points, key=lambda p: p[0])
            for stat, (style, marker) in PERCENTILE_STYLES.items():
                key = f"{stat}_{metric}_ms"
                xs = [x for x, m in points if m.get(key) is not None]
                ys = [m[key] for _, m in points if m.get(key) is not None]
                if ys:
                    ax.plot(xs, ys, style, marker=marker, color=color, label=f"{label} {stat}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or f"latency percentiles vs {xlabel}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
