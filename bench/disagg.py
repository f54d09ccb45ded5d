"""Disaggregated vs colocated serving on one workload, in one run: `jaxserve bench serve` through
routers over a prefill and a decode worker (one or more, e.g. the two KV transports) and through a
router over a colocated worker, in alternating rounds (the machines are shared and noisy), with the
KV transfers each disaggregating router counted meanwhile (its /metrics).

    python -m bench.disagg --split [NAME=]http://H:P ... --colocated http://H:Q [--rounds 2] -- BENCH-SERVE-FLAGS

Prints TTFT, TPOT, inter-token latency, throughput and (with `--slo` among the flags) goodput of
each and their ratios to colocated, and per handed-over prompt of each split router the blocks,
bytes and milliseconds of its transfer, the bytes/s reached and its share of the mean end-to-end
latency (the transfer delays a request's second token: the first comes from the prefill worker).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

METRICS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "output_throughput",
    "mean_e2el_ms",
    "request_goodput",
)
COUNTERS = {
    "transfers": "jaxserve_kv_transfers_total",
    "pulled": 'jaxserve_kv_transfer_blocks_total{kind="pulled"}',
    "skipped": 'jaxserve_kv_transfer_blocks_total{kind="skipped"}',
    "bytes": "jaxserve_kv_transfer_bytes_total",
    "seconds": "jaxserve_kv_transfer_duration_seconds_sum",
    "failed": "jaxserve_kv_transfer_failures_total",
}


def transfer_counters(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=60).read().decode()
    return {k: float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1)) for k, name in COUNTERS.items()}


def bench(base_url: str, flags: list[str], result: Path) -> dict[str, float]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve.cli",
            "bench",
            "serve",
            "--base-url",
            base_url,
            "--no-progress",
            "--result-file",
            str(result),
            *flags,
        ],
        check=True,
    )
    return json.loads(result.read_text())["backends"]["jaxserve"]["results"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--split",
        required=True,
        action="append",
        metavar="[NAME=]URL",
        help="router over prefill and decode workers (repeat to compare several)",
    )
    p.add_argument("--colocated", required=True, help="router over colocated workers")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="round r sends the workload drawn with seed + r, so no round hits the prefix cache of an earlier one",
    )
    p.add_argument("flags", nargs=argparse.REMAINDER, help="`jaxserve bench serve` flags, after --")
    args = p.parse_args()
    flags = [f for f in args.flags if f != "--"]
    splits = dict(s.split("=", 1) if "=" in s else (f"split{i}" if i else "split", s) for i, s in enumerate(args.split))
    urls = {"colocated": args.colocated, **splits}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
    before = {name: transfer_counters(url) for name, url in splits.items()}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(urls)[::-1]
            for name in order:
                runs[name].append(
                    bench(urls[name], [*flags, "--seed", str(args.seed + r)], Path(tmp) / f"{name}-{r}.json")
                )
    after = {name: transfer_counters(url) for name, url in splits.items()}
    mean = {name: {m: sum(x.get(m, 0.0) for x in rs) / args.rounds for m in METRICS} for name, rs in runs.items()}
    print(
        f"{'metric':<22}"
        + "".join(f"{name:>12}" for name in urls)
        + "".join(f"{name + '/colocated':>20}" for name in splits)
    )
    for m in METRICS:
        colo = mean["colocated"][m]
        print(
            f"{m:<22}"
            + "".join(f"{mean[name][m]:>12.2f}" for name in urls)
            + "".join(f"{mean[name][m] / colo if colo else float('nan'):>20.3f}" for name in splits)
        )
    for name in splits:
        d = {k: after[name][k] - before[name][k] for k in COUNTERS}
        n = d["transfers"] or 1
        ms = d["seconds"] / n * 1e3
        print(
            f"{name} KV transfers: {d['transfers']:.0f} ({d['failed']:.0f} failed); per transfer "
            f"{d['pulled'] / n:.1f} blocks pulled, {d['skipped'] / n:.1f} skipped, {d['bytes'] / n / 1e3:.1f} kB, "
            f"{ms:.2f} ms ({ms / mean[name]['mean_e2el_ms']:.1%} of the mean end-to-end latency; the "
            f"first token comes from the prefill worker, so the transfer delays the second); "
            f"{d['bytes'] / d['seconds'] / 1e6 if d['seconds'] else 0:.1f} MB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
