"""Which decode kernel the GPU check's table picks as this GPU generation's default
(recorded in kernels_pallas/gpu_select.py's MEASURED). Plain Python: the supervisor, which never
imports JAX, prints it with the table.

The rule: a kernel that failed or differed from the reference (or from the other kernel, in
the cases too large for the reference) in any case is out; of those left, Mosaic GPU wins when
the geometric mean of its time over Triton's, across the cases both ran, is below 1. Every case
counts the same, so the long-context cases do not drown the short ones (whose launch and
pipeline fill costs differ most between the kernels).
"""

from __future__ import annotations

import math

KERNELS = ("triton", "mosaic")


def _failed(row: dict, kernel: str, tolerance: float) -> bool:
    """Ran here and errored, or differed from the reference or from the other kernel."""
    error = row.get(f"{kernel}_error", "")
    if error and not error.startswith("not run:"):
        return True
    return row.get(f"{kernel}_err", 0.0) > tolerance or row.get("mosaic_vs_triton_err", 0.0) > tolerance


def pick_decode_kernel(rows: list[dict], tolerance: float) -> dict:
    """{"kernel", "why", "mosaic_over_triton" (geometric mean of time ratios, or None), "cases"}."""
    failed = {k: [r["case"] for r in rows if _failed(r, k, tolerance)] for k in KERNELS}
    both = [r for r in rows if r.get("triton_s") and r.get("mosaic_s")]
    ratio = math.exp(sum(math.log(r["mosaic_s"] / r["triton_s"]) for r in both) / len(both)) if both else None
    result = {"mosaic_over_triton": ratio, "cases": len(both)}
    if failed["triton"] and not failed["mosaic"] and any(r.get("mosaic_s") for r in rows):
        return {**result, "kernel": "mosaic", "why": f"triton failed or mismatched in {', '.join(failed['triton'])}"}
    if failed["triton"] or failed["mosaic"]:
        where = "; ".join(f"{k} in {', '.join(cases)}" for k, cases in failed.items() if cases)
        return {**result, "kernel": "triton", "why": f"failed or mismatched: {where}"}
    if ratio is None:
        skipped = next((r["mosaic_error"] for r in rows if r.get("mosaic_error")), "no case timed both kernels")
        return {**result, "kernel": "triton", "why": f"mosaic {skipped}"}
    kernel = "mosaic" if ratio < 1.0 else "triton"
    return {
        **result,
        "kernel": kernel,
        "why": f"mosaic takes {ratio:.2f}x triton's time (geometric mean over {len(both)} cases)",
    }
