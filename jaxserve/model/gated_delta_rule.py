"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) and its causal depthwise conv, as
pure functions of one layer: the chunked form for a prompt's tokens, the recurrent form for one
token per sequence. Inputs are f32; q and k l2-normed, q scaled by d_k^-0.5 (`normed_qk`).

The state S [heads, d_k, d_v] of a sequence follows, per token t:
    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
The chunked form computes the same in chunks of C tokens: within a chunk the delta updates are
one triangular solve (the UT transform), across chunks a scan carries S (as Hugging Face's
`torch_chunk_gated_delta_rule`, whose results it reproduces).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 64  # tokens per chunk of the chunked form


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def normed_qk(q: jax.Array, k: jax.Array, value_heads: int) -> tuple[jax.Array, jax.Array]:
    """q, k [..., key heads, d_k] -> f32 [..., value heads, d_k]: l2-normed, q scaled by d_k^-0.5,
    each key head serving value_heads / key heads consecutive value heads."""
    repeat = value_heads // q.shape[-2]
    q = l2norm(q.astype(jnp.float32)) * q.shape[-1] ** -0.5
    k = l2norm(k.astype(jnp.float32))
    return jnp.repeat(q, repeat, axis=-2), jnp.repeat(k, repeat, axis=-2)


def chunked_gated_delta(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array, chunk: int = CHUNK
) -> tuple[jax.Array, jax.Array]:
    """One sequence: q, k [T, H, d_k], v [T, H, d_v], g, beta [T, H] (T a multiple of `chunk`;
    padding tokens with g = beta = 0 and k = 0 leave the state as it is), state [H, d_k, d_v]
    -> (o [T, H, d_v], the state after the T tokens)."""
    t, h = g.shape
    n = t // chunk

    def chunks(x: jax.Array) -> jax.Array:  # [T, H, ...] -> [H, n, C, ...]
        return jnp.moveaxis(x, 1, 0).reshape(h, n, chunk, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [H, n, C]: log of the decay since the chunk's start
    causal = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [H, n, C, C]
    ut = jnp.einsum("hnik,hnjk->hnij", k_beta, k) * decay

    def solve(b: jax.Array) -> jax.Array:  # (I + strictly lower part of ut)^-1 b
        return lax.linalg.triangular_solve(ut, b, left_side=True, lower=True, unit_diagonal=True)

    new_values = solve(v_beta)
    k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])
    intra = jnp.einsum("hnik,hnjk->hnij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [H, n]

    def step(s: jax.Array, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i, None, None] + jnp.swapaxes(k_decayed[:, i], -1, -2) @ v_new
        return s, out

    state, out = lax.scan(step, state, jnp.arange(n))  # out [n, H, C, d_v]
    return jnp.moveaxis(out, 1, 0).reshape(h, t, -1).swapaxes(0, 1), state


def recurrent_gated_delta(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token of each of S sequences: q, k [S, H, d_k], v [S, H, d_v], g, beta [S, H], state
    [S, H, d_k, d_v] -> (o [S, H, d_v], the states after it)."""
    state = state * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("shkv,shk->shv", state, k)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("shkv,shk->shv", state, q), state


def causal_conv(
    x: jax.Array, conv_state: jax.Array, weight: jax.Array, length: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv of one sequence's new inputs x [T, C] after its last K - 1 inputs
    `conv_state` [K - 1, C], taps `weight` [C, K], then SiLU -> (y [T, C], the last K - 1 inputs
    after the first `length` rows of x, its real ones)."""
    width = weight.shape[1]
    padded = jnp.concatenate([conv_state, x], axis=0)  # [K - 1 + T, C]
    y = sum(padded[j : j + x.shape[0]] * weight[:, j] for j in range(width))
    return jax.nn.silu(y), lax.dynamic_slice_in_dim(padded, length, width - 1, axis=0)
