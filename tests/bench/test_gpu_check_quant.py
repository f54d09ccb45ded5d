"""The GPU check's `quantized_matmul` stage in its dry run (tiny stand-ins of the 8B shapes, on
CPU, in this process): every projection at every row count, timed in bf16, int8 and q4 against
the copy, each quantized matmul within tolerance of a bf16 dot of its dequantized kernel, and its
section of the summary table. The whole dry run (`test_gpu_check.py`, slow) runs it as a stage."""

from bench.gpu_check import quant_stage
from bench.gpu_check.plan import make_plan
from bench.gpu_check.record import StageRecord
from bench.gpu_check.table import render


def test_quantized_matmul_stage_measures_every_projection_against_bf16(tmp_path):
    plan = make_plan(dry_run=True, command_buffer_variant=False)
    stage = plan.stage("quantized_matmul")
    record = StageRecord(tmp_path / "stage.json", stage.name)
    quant_stage.run(plan, stage, record)
    rows = record.data["rows"]
    assert not record.data["problems"]
    assert [(r["case"].split()[0], r["rows"]) for r in rows] == [
        (name, n) for name in quant_stage.projections(plan) for n in plan.quant_rows
    ]
    for r in rows:
        for kind in ("int8", "q4"):
            assert r[f"{kind}_s"] > 0 and r[f"{kind}_pct_copy"] > 0 and r[f"{kind}_err"] <= quant_stage.TOLERANCE
    summary = {
        "stages": [{**record.data, "kind": stage.kind, "status": "ok", "seconds": 1.0, "limit_s": 1.0, "error": None}],
        "command_buffers": "off",
        "total_s": 1.0,
    }
    assert "int8/bf16" in render(summary, plan)
