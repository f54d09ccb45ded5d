"""Disaggregated vs colocated serving on one workload, in one run: `jaxserve bench serve` through a
router over a prefill and a decode worker and through a router over a colocated worker, in
alternating rounds (the machines are shared and noisy), with the KV transfers the disaggregating
router counted meanwhile (its /metrics).

    python -m bench.disagg --split http://H:P --colocated http://H:Q [--rounds 2] -- BENCH-SERVE-FLAGS

Prints TTFT, TPOT and inter-token latency of both and their ratios (split / colocated), and per
handed-over prompt the blocks, bytes and milliseconds of its transfer, and the bytes/s reached.
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

METRICS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "median_itl_ms", "output_throughput")
COUNTERS = {"transfers": "jaxserve_kv_transfers_total", "pulled": 'jaxserve_kv_transfer_blocks_total{kind="pulled"}',
            "skipped": 'jaxserve_kv_transfer_blocks_total{kind="skipped"}', "bytes": "jaxserve_kv_transfer_bytes_total",
            "seconds": "jaxserve_kv_transfer_duration_seconds_sum", "failed": "jaxserve_kv_transfer_failures_total"}


def transfer_counters(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=60).read().decode()
    return {k: float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1)) for k, name in COUNTERS.items()}


def bench(base_url: str, flags: list[str], result: Path) -> dict[str, float]:
    subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--base-url", base_url, "--no-progress",
                    "--result-file", str(result), *flags], check=True)
    return json.loads(result.read_text())["backends"]["jaxserve"]["results"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", required=True, help="router over prefill and decode workers")
    p.add_argument("--colocated", required=True, help="router over colocated workers")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("flags", nargs=argparse.REMAINDER, help="`jaxserve bench serve` flags, after --")
    args = p.parse_args()
    flags = [f for f in args.flags if f != "--"]
    runs: dict[str, list[dict[str, float]]] = {"split": [], "colocated": []}
    before = transfer_counters(args.split)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in ("colocated", "split") if r % 2 == 0 else ("split", "colocated"):
                runs[name].append(bench(getattr(args, name), flags, Path(tmp) / f"{name}-{r}.json"))
    after = transfer_counters(args.split)
    print(f"{'metric':<22}{'colocated':>12}{'split':>12}{'split/colocated':>17}")
    for m in METRICS:
        colo = sum(x[m] for x in runs["colocated"]) / args.rounds
        split = sum(x[m] for x in runs["split"]) / args.rounds
        print(f"{m:<22}{colo:>12.2f}{split:>12.2f}{split / colo:>17.3f}")
    d = {k: after[k] - before[k] for k in COUNTERS}
    n = d["transfers"] or 1
    print(f"KV transfers: {d['transfers']:.0f} ({d['failed']:.0f} failed); per transfer {d['pulled'] / n:.1f} blocks "
          f"pulled, {d['skipped'] / n:.1f} skipped, {d['bytes'] / n / 1e3:.1f} kB, {d['seconds'] / n * 1e3:.2f} ms; "
          f"{d['bytes'] / d['seconds'] / 1e6 if d['seconds'] else 0:.1f} MB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
