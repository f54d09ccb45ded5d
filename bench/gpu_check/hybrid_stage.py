"""Stage `hybrid`: the Gated DeltaNet layer's delta rule (the linear attention of Qwen3.5's hybrid
layers, jaxserve/model/gated_delta_rule.py), checked and timed on the device.

- The chunked form, as a prompt runs it (a scan over chunks of 64 tokens, a triangular solve each),
  against the recurrent form run token by token (the reference, and the peer timed in the same
  run), f32, one sequence of T tokens from a random state, at Qwen3.5's layer shape (16 key heads,
  32 value heads of 128; the dry run: tiny): max error of outputs and final state, ms of each.
- The recurrent form as a decode step runs it: one token of B sequences, ms per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from bench import kernel_bench
from bench.gpu_check.plan import Plan, Stage
from bench.gpu_check.record import StageRecord, describe_error
from bench.kernel_bench import random_normal
from jaxserve.model.gated_delta_rule import chunked_gated_delta, normed_qk, recurrent_gated_delta

# (tokens of the prompt, key heads, value heads, d_k = d_v, decode batch)
GPU_SHAPE, DRY_SHAPE = (2048, 16, 32, 128, 64), (128, 2, 4, 16, 4)
BOUND = 1e-3  # f32, relative to the largest output: the two forms sum in different orders over T tokens


def _inputs(t: int, key_heads: int, heads: int, d: int, seed: int) -> tuple[jax.Array, ...]:
    q, k = normed_qk(
        random_normal(seed, (t, key_heads, d), "float32"), random_normal(seed + 1, (t, key_heads, d), "float32"), heads
    )
    v = random_normal(seed + 2, (t, heads, d), "float32")
    g = -jax.nn.softplus(random_normal(seed + 3, (t, heads), "float32"))
    beta = jax.nn.sigmoid(random_normal(seed + 4, (t, heads), "float32"))
    return q, k, v, g, beta, 0.1 * random_normal(seed + 5, (heads, d, d), "float32")


@jax.jit
def _token_by_token(q, k, v, g, beta, state):
    def step(s, x):
        out, s = recurrent_gated_delta(*(a[None] for a in x), s[None])
        return s[0], out[0]

    state, out = lax.scan(step, state, (q, k, v, g, beta))
    return out, state


def _error(got: tuple[jax.Array, ...], want: tuple[jax.Array, ...]) -> dict:
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
    bound = BOUND * max(1.0, *(float(jnp.max(jnp.abs(b))) for b in want))
    return {"max_err": err, "bound": bound, "ok": bool(err <= bound)}


def run(plan: Plan, stage: Stage, record: StageRecord) -> None:
    t, key_heads, heads, d, batch = DRY_SHAPE if plan.dry_run else GPU_SHAPE
    record.info(tokens=t, key_heads=key_heads, value_heads=heads, head_dim=d, decode_batch=batch)
    args = _inputs(t, key_heads, heads, d, seed=1)
    shape = f"{key_heads}/{heads} heads of {d}"
    base = {"check": "gated delta rule", "dtype": "float32", "shape": shape}
    want = _token_by_token(*args)
    chunked = jax.jit(chunked_gated_delta)
    rows = []
    for impl, fn, compare in (("chunked", chunked, True), ("token by token", _token_by_token, False)):
        row = {**base, "impl": impl, "rows": t}
        try:
            row.update(_error(fn(*args), want) if compare else {"ok": True})
            row["ms"] = 1e3 * kernel_bench.time_call(lambda fn=fn: fn(*args), plan.iters)
        except Exception as e:  # one failing form must not hide the other
            row.update(ok=False, error=describe_error(e))
        rows.append(row)
    decode = _inputs(batch, key_heads, heads, d, seed=7)
    states = jnp.broadcast_to(decode[-1], (batch, *decode[-1].shape))
    step = jax.jit(recurrent_gated_delta)
    ms = 1e3 * kernel_bench.time_call(lambda: step(*decode[:-1], states), plan.iters)
    rows.append({**base, "impl": "recurrent (decode step)", "rows": batch, "ms": ms, "ok": True})
    for row in rows:
        record.row(row)
        if not row["ok"]:
            record.problem(f"{row['impl']}: {row.get('error') or 'differs from the token-by-token reference'}")
