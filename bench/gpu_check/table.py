"""The GPU check's summary (gpu_check.json) as a text table; the dry run prints the same columns."""

from __future__ import annotations

import io
from typing import Any

from bench.gpu_check.plan import Plan
from bench.kernel_report import print_prefill_table

ENGINE_COLUMNS = [
    "model",
    "batch",
    "ctx",
    "tok/s",
    "step ms",
    "device ms",
    "roofline ms",
    "%roof",
    "%roof dev",
    "host %",
    "host % sync",
    "compiles",
    "xla compiles",
    "warm-up s",
]


def _f(x: Any, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.2f}"


def _grid(headers: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns padded to their widest cell; those in `left` left-aligned, the others right-aligned."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def _stages_section(summary: dict) -> list[str]:
    rows = []
    for s in summary["stages"]:
        note = s["error"] or "; ".join(s["problems"][:2]) or ""
        if len(s["problems"]) > 2:
            note += f" (+{len(s['problems']) - 2} more)"
        rows.append([s["name"], s["status"], _f(s["seconds"]), _f(s["limit_s"], 0), note[:140]])
    return _grid(["stage", "status", "seconds", "limit", "note"], rows, left=(0, 4))


def _correctness_section(stage: dict) -> list[str]:
    rows = [
        [
            f"{r['kernel']} {r['variant']}",
            r["model"],
            r["dtype"],
            r["shape"],
            "n/a" if r.get("max_err") is None else f"{r['max_err']:.1e}",
            "n/a" if r.get("bound") is None else f"{r['bound']:.1e}",
            "yes" if r["ok"] else f"NO: {r.get('error', '')[:60]}",
        ]
        for r in stage["rows"]
    ]
    return _grid(["case", "model", "dtype", "shape", "max err", "bound", "ok"], rows, left=(0, 6))


def _decode_section(stage: dict, dry_run: bool) -> list[str]:
    """Both decode kernels per case (ms, % of the copy bandwidth, speedup over JAX's op), JAX's op,
    the reference, each kernel's largest difference from the reference, then the pick."""
    info = stage["info"]
    rows = []
    notes = []
    for r in stage["rows"]:
        cells = [r["case"], _f(r["kv_bytes"] / 1e6)]
        for k in ("triton", "mosaic"):
            cells += [_ms(r.get(f"{k}_s")), _f(r.get(f"{k}_pct_copy")), _f(r.get(f"{k}_x_shipped"), 2)]
        cells += [_ms(r.get("shipped_s")), _ms(r.get("reference_s"))]
        cells += ["n/a" if r.get(f"{k}_err") is None else f"{r[f'{k}_err']:.1e}" for k in ("triton", "mosaic")]
        rows.append(cells)
        notes += [
            f"  {r['case']}: {k}: {r[f'{k}_error']}"
            for k in ("triton", "mosaic", "shipped", "reference")
            if r.get(f"{k}_error")
        ]
    headers = [
        "decode case",
        "KV MB",
        "triton ms",
        "%copy",
        "x jax",
        "mosaic ms",
        "%copy",
        "x jax",
        "jax ms",
        "ref ms",
        "err triton",
        "err mosaic",
    ]
    out = [f"copy bandwidth (read + write): {info['copy_bps'] / 1e9:.1f} GB/s"] + _grid(headers, rows)
    out += sorted(set(notes), key=notes.index)
    pick = info.get("pick")
    if pick:
        where = f"compute capability {info.get('compute_capability')} ({info.get('device')})"
        if dry_run:
            out.append(f"pick (dry run: interpreter timings, not a measurement): {pick['kernel']}: {pick['why']}")
        else:
            out.append(f"pick for {where}: {pick['kernel']}: {pick['why']}")
            out.append(
                f"record it: kernels_pallas/gpu_select.py MEASURED[{info.get('compute_capability')!r}] = "
                f"{pick['kernel']!r} (the default now: {info.get('shipped_default')})"
            )
    return out


def _mla_section(stage: dict) -> list[str]:
    info = stage["info"]
    head = (
        f"{info['heads']} heads, latent {info['latent_dim']} + {info['rope_dim']}, {info['dtype']}; GB/s: latent bytes"
    )
    rows = [
        [r["case"], _ms(r.get("kernel_s")), _ms(r.get("reference_s")), _f(r.get("latent_gbps")), _f(r.get("pct_copy"))]
        + [r.get("error", f"{r['err']:.2g}" if "err" in r else "")]
        for r in stage["rows"]
    ]
    return [head] + _grid(["case", "kernel ms", "ref ms", "GB/s", "%copy", "err"], rows)


def _speculative_section(stage: dict) -> list[str]:
    info = stage["info"]
    head = (
        f"{info['model']}, {info['dtype']}, {info['draft_tokens']} drafts per step; D, V: drafting and the verify "
        f"pass per step over a plain step T; break-even: accepted drafts per step where (1 + a) T = D + V; "
        f"greedy outputs identical: {info.get('greedy_outputs_identical')}"
    )
    rows = [
        [str(r["batch"]), _f(r["tok_per_s"], 0), _f(r["plain_tok_per_s"], 0), _f(r["ratio"], 2)]
        + [_f(r.get(k), 2) for k in ("acceptance_rate", "draft_over_plain", "verify_over_plain", "break_even_accepted")]
        for r in stage["rows"]
    ]
    return [head] + _grid(["batch", "spec tok/s", "plain tok/s", "ratio", "accept", "D/T", "V/T", "break-even a"], rows)


def _vision_section(stage: dict) -> list[str]:
    info = stage["info"]
    tower, check = info["tower"], info.get("correctness", {})
    head = (
        f"{tower['num_layers']} layers of {tower['hidden_size']}, {tower['image_size']}-pixel images in "
        f"{tower['patch_size']}-pixel patches -> {tower['mm_tokens_per_image']} tokens of "
        f"{tower['text_hidden_size']}, {info['dtype']} weights, f32 compute; ms: pixels in, soft tokens "
        f"on the host; vs float64 numpy ({check.get('shape', 'n/a')}): max err "
        + ("n/a" if "max_err" not in check else f"{check['max_err']:.1e} (bound {check['bound']:.1e})")
    )
    rows = [
        [str(r["images"]), _f(r["ms_per_call"], 2), _f(r["ms_per_image"], 2), _f(r["tflops"], 2)] for r in stage["rows"]
    ]
    return [head] + _grid(["images", "ms/call", "ms/image", "TFLOP/s"], rows)


def _models_section(stage: dict) -> list[str]:
    rows = [
        [
            r["check"],
            r.get("impl", ""),
            r["dtype"],
            str(r.get("rows", "")),
            r.get("shape", ""),
            "n/a" if r.get("max_err") is None else f"{r['max_err']:.1e}",
            "n/a" if r.get("bound") is None else f"{r['bound']:.1e}",
            _f(r.get("ms"), 3),
            "yes" if r["ok"] else f"NO: {r.get('error', '')[:60]}",
        ]
        for r in stage["rows"]
    ]
    return _grid(["check", "impl", "dtype", "rows", "shape", "max err", "bound", "ms", "ok"], rows, left=(0, 1, 4, 8))


def _quant_section(stage: dict) -> list[str]:
    rows = [
        [
            r["case"],
            _ms(r["bf16_s"]),
            _ms(r["int8_s"]),
            _f(r["int8_over_bf16"], 2),
            _f(r["int8_pct_copy"]),
            _ms(r["q4_s"]),
            _f(r["q4_over_bf16"], 2),
            _f(r["q4_pct_copy"]),
        ]
        for r in stage["rows"]
    ]
    return _grid(["matmul", "bf16 ms", "int8 ms", "int8/bf16", "int8 % copy", "q4 ms", "q4/bf16", "q4 % copy"], rows)


def _engine_rows(stages: list[dict]) -> list[list[str]]:
    """A row per engine stage run with overlap (async scheduling) on and batch; "host % sync" is
    the same model and batch with overlap off, when that optional stage ran. A multi-step stage's
    times are per decode step (K of them per engine step)."""
    engine = [s for s in stages if s["kind"] == "engine"]
    sync = {(s["model"], r["batch"]): r for s in engine if not s["overlap"] for r in s["rows"]}
    rows = []
    for s in (s for s in engine if s["overlap"]):
        label = (
            s["model"]
            + (" (no cmdbuf)" if s["name"].endswith("_no_cmdbuf") else "")
            + (f" ({s['scheduler_steps']}-step)" if s.get("scheduler_steps", 1) > 1 else "")
            + (" (unrolled)" if s.get("unroll_layers") else "")
        )
        info = s["info"]
        for r in s["rows"]:
            off = sync.get((s["model"], r["batch"])) if s.get("scheduler_steps", 1) == 1 else None
            rows.append(
                [
                    label,
                    str(r["batch"]),
                    _f(r["mean_context"], 0),
                    _f(r["tok_per_s"], 0),
                    _ms(r["step_s"]),
                    _ms(r["device_s"]),
                    _ms(r["roofline_s"]),
                    _f(r["pct_roofline"]),
                    _f(r["pct_roofline_device"]),
                    _f(r["host_pct"]),
                    _f(off["host_pct"]) if off else "n/a",
                    str(info.get("compilations_after_warm_up", "n/a")),
                    str(info.get("xla_compilations_serving", "n/a")),
                    _f(info.get("warm_up_s")),
                ]
            )
    return rows


def _goal_rows(stages: dict[str, dict], plan: Plan) -> list[list[str]]:
    decode_stage = stages.get("decode_kernels", {})
    kernel = decode_stage.get("info", {}).get("pick", {}).get("kernel", "triton")
    decode = [
        r
        for r in decode_stage.get("rows", [])
        if r["batch"] >= plan.goal_kernel_min_batch and r["context"] >= plan.goal_kernel_min_context
    ]
    pct = [r[f"{kernel}_pct_copy"] for r in decode if r.get(f"{kernel}_pct_copy") is not None]
    vs_jax = [r[f"{kernel}_x_shipped"] for r in decode if r.get(f"{kernel}_x_shipped") is not None]
    cases = f"{kernel}, the pick; batch >= {plan.goal_kernel_min_batch}, context >= {plan.goal_kernel_min_context}"
    big = stages.get("engine_llama3-8b", {}).get("rows", [])
    roof = [r["pct_roofline"] for r in big if r["batch"] == plan.goal_engine_batch]
    engine = [s for s in stages.values() if s["kind"] == "engine" and not s["name"].endswith("_no_cmdbuf")]
    host_on = [
        r["host_pct"]
        for s in engine
        if s["overlap"] and s.get("scheduler_steps", 1) == 1
        for r in s["rows"]
        if r["host_pct"] is not None
    ]

    def met(values: list[float], ok) -> str:
        return "n/a" if not values else ("yes" if ok(values) else "no")

    return [
        [
            f"decode kernel % of copy ({cases})",
            f"min {_f(min(pct))}" if pct else "n/a",
            ">= 80",
            met(pct, lambda v: min(v) >= 80),
        ],
        [
            "decode kernel x JAX's paged_attention (same cases)",
            f"min {_f(min(vs_jax), 2)}" if vs_jax else "n/a",
            ">= 1.5",
            met(vs_jax, lambda v: min(v) >= 1.5),
        ],
        [
            f"engine decode step, llama3-8b at batch {plan.goal_engine_batch}, % of HBM roofline",
            _f(roof[0]) if roof else "n/a",
            ">= 70",
            met(roof, lambda v: v[0] >= 70),
        ],
        [
            "host % of a step, overlap on",
            f"max {_f(max(host_on))}" if host_on else "n/a",
            "< 5",
            met(host_on, lambda v: max(v) < 5),
        ],
    ]


def _family_sections(stages: dict[str, dict]) -> list[str]:
    """The sections of the quantized matmuls, MLA, speculative decoding and the vision encoder."""
    out: list[str] = []
    if stages.get("quantized_matmul", {}).get("rows"):
        out += [
            "",
            "weight-only quantized layer matmuls (dequantize fused into a bf16 dot) vs bf16, 8B shapes; "
            "% copy: weight bytes per second over the device copy's",
        ] + _quant_section(stages["quantized_matmul"])
    if stages.get("mla_decode_kernel", {}).get("rows"):
        out += ["", "MLA decode kernel vs the pure-JAX absorbed form"] + _mla_section(stages["mla_decode_kernel"])
    if stages.get("speculative", {}).get("rows"):
        out += ["", "MTP speculative decoding (random MTP layer) against plain decoding"]
        out += _speculative_section(stages["speculative"])
    if stages.get("vision_encoder", {}).get("rows"):
        out += ["", "vision encoder (Gemma 3 4B's SigLIP and projector, random weights)"]
        out += _vision_section(stages["vision_encoder"])
    return out


def render(summary: dict, plan: Plan) -> str:
    stages = {s["name"]: s for s in summary["stages"]}
    env = stages.get("env", {}).get("info", {})
    out: list[str] = [
        f"jaxserve GPU check ({'DRY RUN: CPU, tiny shapes, kernels interpreted' if plan.dry_run else 'GPU'}): "
        f"{env.get('device_kind', '?')} ({env.get('backend', '?')}), jax {env.get('jax', '?')}, "
        f"Pallas {'interpreted' if env.get('pallas_interpret') else 'native'}, "
        f"Triton command buffers {summary['command_buffers']}; {summary['total_s']:.0f} s of {plan.budget_s:.0f} s",
        "",
    ]
    out += _stages_section(summary)
    if stages.get("correctness", {}).get("rows"):
        out += ["", "kernel correctness (vs kernels_pallas/reference.py)"] + _correctness_section(stages["correctness"])
        if stages["correctness"]["info"].get("mosaic", "").startswith("not run"):
            out.append(f"decode_mosaic: {stages['correctness']['info']['mosaic']}")
    if stages.get("models", {}).get("rows"):
        out += [
            "",
            "model families' blocks (grouped expert matmuls vs every expert on every row; sliding-window "
            "kernels vs the reference)",
        ] + _models_section(stages["models"])
    if stages.get("hybrid", {}).get("rows"):
        out += ["", "Gated DeltaNet delta rule (chunked vs token by token; decode step)"]
        out += _models_section(stages["hybrid"])
    for name, title in (("decode_kernels", "decode kernels"), ("prefill_kernels", "prefill kernel")):
        stage = stages.get(name)
        if not stage or not stage["rows"]:
            continue
        info = stage["info"]
        text = io.StringIO()
        if name == "decode_kernels" and info.get("copy_bps"):
            text.write("\n".join(_decode_section(stage, plan.dry_run)))
        elif name == "prefill_kernels" and info.get("matmul_flops"):
            print_prefill_table(stage["rows"], info["matmul_flops"], text)
        if text.getvalue():
            out += ["", f"{title} ({info.get('dtype')}, {info.get('model_shape')} attention shape)"]
            out += text.getvalue().rstrip("\n").splitlines()
    out += _family_sections(stages)
    engine_rows = _engine_rows(summary["stages"])
    if engine_rows:
        out += ["", "engine decode (LLMEngine, pallas attention, random weights; ctx = mean tokens per sequence)"]
        out += _grid(ENGINE_COLUMNS, engine_rows)
    out += [
        "",
        "goals (issue 16)"
        + ("; dry-run figures are CPU timings of tiny shapes, the goals are for the GPU" if plan.dry_run else ""),
    ]
    out += _grid(["goal", "measured", "target", "met"], _goal_rows(stages, plan), left=(0, 1))
    return "\n".join(out) + "\n"
