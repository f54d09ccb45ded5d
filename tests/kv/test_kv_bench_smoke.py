"""The KV micro-benchmark still runs (small sizes); its figures are read by people, not asserted."""

from bench import kv_bench


def test_kv_bench_quick_run_prints_every_figure(capsys) -> None:
    kv_bench.main(["--quick"])
    out = capsys.readouterr().out
    for name in ("allocate(1) + free", "full hit", "miss", "insert:", "evict:", "decode step"):
        assert name in out
