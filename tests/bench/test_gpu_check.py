"""`python3 -m bench.gpu_check --dry-run`: the GPU check's stages, run on CPU with tiny shapes and
interpreted kernels, so the command a GPU machine runs cannot rot between GPU draws."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check.decode_pick import pick_decode_kernel
from bench.gpu_check.plan import Stage, make_plan
from bench.gpu_check.supervise import run_stage
from bench.gpu_check.table import ENGINE_COLUMNS

REPO = Path(__file__).resolve().parents[2]
PLAN = make_plan(dry_run=True, command_buffer_variant=False)
# The dry run's own budget bounds it; pytest's default limit (pyproject) is shorter.
pytestmark = pytest.mark.timeout(int(PLAN.budget_s) + 120)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=PLAN.budget_s + 60,
    )
    summary = json.loads((out / "gpu_check.json").read_text())
    return proc, summary, (out / "gpu_check.txt").read_text()


def stage(summary: dict, name: str) -> dict:
    return next(s for s in summary["stages"] if s["name"] == name)


@pytest.mark.slow
def test_every_stage_runs_and_passes(dry_run):
    proc, summary, table = dry_run
    assert [s["name"] for s in summary["stages"]] == [s.name for s in PLAN.stages]
    # An optional stage runs only in the time the others left (see __main__.Run.stage).
    failed = {
        s["name"]: s["error"] or s["problems"]
        for s in summary["stages"]
        if s["status"] != "ok" and not (s["status"] == "skipped" and PLAN.stage(s["name"]).optional)
    }
    assert not failed, f"{failed}\n{proc.stdout[-3000:]}"
    assert proc.returncode == 0
    assert summary["mode"] == "dry-run"
    assert stage(summary, "env")["info"]["pallas_interpret"] is True
    assert proc.stdout.endswith(table), "the table is printed as well as written"


def mosaic_interpreted_here() -> bool:
    """Whether this jax runs the Mosaic GPU kernel in the dry run (its interpreter is public from 0.11)."""
    code = "from kernels_pallas import decode_mosaic; print(decode_mosaic.interpret_available())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    return out.stdout.strip() == "True"


@pytest.mark.slow
def test_correctness_compares_every_kernel_in_both_dtypes(dry_run):
    correctness = stage(dry_run[1], "correctness")
    rows = correctness["rows"]
    want = {(k, d) for k in ("decode", "prefill") for d in ("float32", "bfloat16")}
    if mosaic_interpreted_here():
        want.add(("decode_mosaic", "bfloat16"))  # it takes no f32 cache
    else:
        assert correctness["info"]["mosaic"].startswith("not run: jax")
    assert {(r["kernel"], r["dtype"]) for r in rows} == want
    assert all(r["ok"] and r["padding_zero"] and r["max_err"] <= r["bound"] for r in rows)


@pytest.mark.slow
def test_kernel_stages_measure_every_case_against_their_peers(dry_run):
    summary = dry_run[1]
    decode = stage(summary, "decode_kernels")
    assert decode["info"]["copy_bps"] > 0
    assert [(r["batch"], r["context"]) for r in decode["rows"]] == [
        (b, c) for b in PLAN.decode_batches for c in PLAN.decode_contexts
    ]
    mosaic = mosaic_interpreted_here()
    for r in decode["rows"]:
        assert r["triton_gbps"] > 0 and r["shipped_s"] > 0 and r["triton_x_shipped"] > 0
        assert r["triton_err"] <= 2e-2  # bf16
        if mosaic:
            assert r["mosaic_gbps"] > 0 and r["mosaic_x_shipped"] > 0
            assert r["mosaic_err"] <= 2e-2 and r["mosaic_vs_triton_err"] <= 2e-2
        else:
            assert r["mosaic_s"] is None and r["mosaic_error"].startswith("not run: jax")
    pick = decode["info"]["pick"]
    assert pick["kernel"] in ("triton", "mosaic") and pick["cases"] == (len(decode["rows"]) if mosaic else 0)
    prefill = stage(summary, "prefill_kernels")
    assert prefill["info"]["matmul_flops"] > 0
    assert len(prefill["rows"]) == len(PLAN.prefill_cases)
    assert all(r["ours_pct_peak"] > 0 for r in prefill["rows"])


@pytest.mark.slow
def test_mla_decode_stage_measures_the_kernel_against_the_reference(dry_run):
    mla = stage(dry_run[1], "mla_decode_kernel")
    assert mla["status"] == "ok" and mla["info"]["copy_bps"] > 0 and mla["rows"]
    for r in mla["rows"]:
        assert r["err"] <= 2e-2 and r["kernel_s"] > 0 and r["reference_s"] > 0 and r["pct_copy"] > 0  # bf16
    assert "MLA decode kernel vs the pure-JAX absorbed form" in dry_run[2]


@pytest.mark.slow
def test_speculative_stage_measures_mtp_costs_against_plain_decoding(dry_run):
    spec = stage(dry_run[1], "speculative")
    assert spec["status"] == "ok" and spec["info"]["greedy_outputs_identical"] is True
    for r in spec["rows"]:
        assert r["tok_per_s"] > 0 and r["plain_tok_per_s"] > 0 and r["draft_over_plain"] > 0
        assert r["verify_over_plain"] > 0 and 0 <= r["acceptance_rate"] <= 1
    assert "MTP speculative decoding (random MTP layer) against plain decoding" in dry_run[2]


@pytest.mark.slow
def test_engine_stages_compile_nothing_after_warm_up(dry_run):
    summary = dry_run[1]
    for model in PLAN.models:
        s = stage(summary, f"engine_{model}")
        info = s["info"]
        assert info["compilations_after_warm_up"] == 0 and info["xla_compilations_serving"] == 0
        assert info["warm_up_s"] > 0 and info["compilations_at_warm_up"] > 0
        assert [r["batch"] for r in s["rows"]] == list(PLAN.workload.batches)
        for r in s["rows"]:
            assert r["tokens"] == r["steps"] * r["batch"], "every timed step decodes the whole batch"
            assert r["prefill_tokens_in_window"] == 0
            assert r["tok_per_s"] > 0 and r["device_s"] > 0 and r["roofline_s"] > 0
            assert 0 <= r["host_pct"] <= 100
            assert r["mean_context"] > PLAN.workload.prompt_len


@pytest.mark.slow
def test_table_has_the_columns_of_the_gpu_run(dry_run):
    table = dry_run[2]
    lines = table.splitlines()
    assert lines[0].startswith("jaxserve GPU check (DRY RUN")
    assert any(line.split() == "  ".join(ENGINE_COLUMNS).split() for line in lines)
    assert any(
        line.startswith("decode case") and "%copy" in line and "x jax" in line and "mosaic ms" in line for line in lines
    )
    assert any(line.startswith("pick (dry run: interpreter timings, not a measurement): ") for line in lines)
    assert any(line.startswith("prefill case") and "%peak" in line for line in lines)
    engine_rows = [line for line in lines if line.split()[:1] and line.split()[0] in PLAN.models]
    multi_step = [line for line in engine_rows if "-step)" in line]
    unrolled = [line for line in engine_rows if "(unrolled)" in line]
    assert len(engine_rows) - len(multi_step) - len(unrolled) == len(PLAN.models) * len(PLAN.workload.batches)
    assert len(multi_step) in (0, len(PLAN.workload.batches))  # the optional multi-step stage
    assert len(unrolled) in (0, len(PLAN.workload.batches))  # the optional unrolled stage
    for s in PLAN.stages:  # optional stages run only in the time the others left
        states = ("ok", "skipped") if s.optional else ("ok",)
        assert any(line.split()[:1] == [s.name] and line.split()[1] in states for line in lines), s.name


def test_a_stage_that_overruns_or_crashes_is_recorded(tmp_path):
    timed_out = run_stage(PLAN.stage("correctness"), tmp_path, True, limit_s=1, command_buffers=False)
    assert timed_out["status"] == "timeout" and "1 s limit" in timed_out["error"]
    crashed = run_stage(Stage("no_such_stage", "env", 30), tmp_path, True, limit_s=30, command_buffers=False)
    assert crashed["status"] == "failed" and "no stage 'no_such_stage'" in crashed["error"]


def test_supervisor_never_imports_jax():
    """It must hold no device memory, which the stages' processes need."""
    code = "import sys, bench.gpu_check.__main__; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_stages_import_without_the_packages_the_gpu_machine_lacks():
    """The GPU machine has jax, flax, orbax, numpy and tokenizers, but not jinja2, gguf or safetensors."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jinja2', 'gguf', 'safetensors', 'sentencepiece'):\n"
        "            raise ImportError(f'{name} is not on the GPU machine')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from bench.gpu_check import stage\n"
        "import importlib\n"
        "for module, _ in stage.RUNNERS.values():\n"
        "    importlib.import_module(module)\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )


def _row(case, triton_s, mosaic_s, **extra):
    return {
        "case": case,
        "triton_s": triton_s,
        "mosaic_s": mosaic_s,
        "triton_err": 1e-3,
        "mosaic_err": 1e-3,
        "mosaic_vs_triton_err": 1e-3,
        **extra,
    }


def test_pick_follows_the_geometric_mean_of_time_ratios():
    """Mosaic 2x faster in one case and 1.5x slower in the other: geometric mean 0.87, Mosaic."""
    rows = [_row("a", 2.0, 1.0), _row("b", 1.0, 1.5)]
    pick = pick_decode_kernel(rows, 2e-2)
    assert pick["kernel"] == "mosaic" and pick["cases"] == 2 and abs(pick["mosaic_over_triton"] - 0.75**0.5) < 1e-9
    assert pick_decode_kernel([_row("a", 1.0, 1.2), _row("b", 1.0, 0.9)], 2e-2)["kernel"] == "triton"


def test_pick_drops_a_kernel_that_failed_or_mismatched():
    mismatched = [_row("a", 2.0, 1.0), _row("b", 2.0, 1.0, mosaic_err=0.5)]
    pick = pick_decode_kernel(mismatched, 2e-2)
    assert pick["kernel"] == "triton" and "mosaic in b" in pick["why"]
    crashed = [_row("a", None, 1.0, triton_error="RuntimeError: boom"), _row("b", 1.0, 1.1)]
    assert pick_decode_kernel(crashed, 2e-2)["kernel"] == "mosaic"
    disagree = [_row("a", 1.0, 0.5, mosaic_vs_triton_err=0.3)]  # too large for the reference: no _err
    assert pick_decode_kernel(disagree, 2e-2)["kernel"] == "triton"


def test_pick_is_triton_when_mosaic_could_not_run():
    rows = [_row("a", 1.0, None, mosaic_error="not run: needs a Hopper GPU (compute capability 9.x), this is 8.0")]
    del rows[0]["mosaic_err"], rows[0]["mosaic_vs_triton_err"]
    pick = pick_decode_kernel(rows, 2e-2)
    assert pick["kernel"] == "triton" and "needs a Hopper GPU" in pick["why"] and pick["mosaic_over_triton"] is None


@pytest.mark.slow
def test_lora_stage_times_adapter_rows_against_base_rows(dry_run):
    lora = stage(dry_run[1], "lora")
    assert [r["case"] for r in lora["rows"]] == [
        "base rows, runner without LoRA",
        "base rows, LoRA runner",
        "rows over 8 adapters, LoRA runner",
    ]
    assert all(r["ms"] > 0 for r in lora["rows"]) and not lora["problems"]
    assert lora["info"]["adapters"] == 8 and lora["info"]["ratio_8_adapters"] > 0


def test_hybrid_stage_checks_the_chunked_delta_rule_against_token_by_token(tmp_path):
    """Stage `hybrid` on its own (the dry run runs it too): the chunked form within its bound of the
    token-by-token reference, both timed, and a decode step timed."""
    result = run_stage(
        PLAN.stage("hybrid"), tmp_path, True, limit_s=PLAN.stage("hybrid").limit_s, command_buffers=False
    )
    assert result["status"] == "ok", result
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {"chunked", "token by token", "recurrent (decode step)"}
    assert rows["chunked"]["max_err"] <= rows["chunked"]["bound"] and all(r["ms"] > 0 for r in rows.values())


def test_vision_encoder_stage_checks_the_served_tower_and_times_each_bucket(tmp_path):
    """Stage `vision_encoder` on its own (the dry run runs it too): the served encoder within its bound
    of the float64 reference, a row per image-count bucket, nothing compiled after warm-up."""
    spec = PLAN.stage("vision_encoder")
    result = run_stage(spec, tmp_path, True, limit_s=spec.limit_s, command_buffers=False)
    assert result["status"] == "ok", result
    info = result["info"]
    assert 0 < info["correctness"]["max_err"] <= info["correctness"]["bound"]
    assert info["compilations_at_warm_up"] == 3 and info["compilations_after_warm_up"] == 0
    assert [r["images"] for r in result["rows"]] == [1, 2, 4]
    assert all(r["ms_per_image"] > 0 and r["tflops"] > 0 for r in result["rows"])


def test_vision_reference_follows_the_tower():
    """The stage's float64 reference is a second implementation: it equals the tower's JAX forward on
    the tiny tower, and a perturbed weight moves it (so the stage's check can fail)."""
    import jax.numpy as jnp
    import numpy as np

    from bench.gpu_check import vision_stage
    from checkpoints.architectures import gemma3_vision
    from checkpoints.weights import random_tree
    from jaxserve.model.vision import image_embeddings

    v = vision_stage.tower_config(dry_run=True)
    params = random_tree(gemma3_vision.weights(v), 0, jnp.float32)
    pixels = np.stack([i.pixels for i in vision_stage.random_images(v, 2, seed=0)])
    want = np.asarray(image_embeddings(v, params, pixels))
    got = vision_stage.reference_embeddings(v, params, pixels)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))
    params["layers"]["fc2"]["kernel"] = params["layers"]["fc2"]["kernel"] * 1.01
    moved = vision_stage.reference_embeddings(v, params, pixels)
    assert np.max(np.abs(moved - want)) > 1e-3 * np.max(np.abs(want))
