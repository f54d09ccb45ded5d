"""The gated delta rule's chunked form equals its recurrent form token by token, from any state,
however the tokens are split into chunks, and padding tokens leave the state as it is."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.gated_delta_rule import chunked_gated_delta, normed_qk, recurrent_gated_delta


def random_inputs(t: int, key_heads: int = 2, heads: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = normed_qk(
        jnp.asarray(rng.standard_normal((t, key_heads, dk)), jnp.float32),
        jnp.asarray(rng.standard_normal((t, key_heads, dk)), jnp.float32),
        heads,
    )
    v = jnp.asarray(rng.standard_normal((t, heads, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, (t, heads)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (t, heads)), jnp.float32)
    state = jnp.asarray(rng.standard_normal((heads, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


def recurrent(q, k, v, g, beta, state):
    outs = []
    for i in range(q.shape[0]):
        out, state = recurrent_gated_delta(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], state[None]
        )
        outs.append(out[0])
        state = state[0]
    return jnp.stack(outs), state


def test_chunked_equals_recurrent_with_padding():
    q, k, v, g, beta, state = random_inputs(40)
    want_out, want_state = recurrent(q, k, v, g, beta, state)
    pad = lambda a: jnp.pad(a, ((0, 8),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731  # 48 = 3 chunks of 16
    out, final = jax.jit(chunked_gated_delta, static_argnums=6)(pad(q), pad(k), pad(v), pad(g), pad(beta), state, 16)
    np.testing.assert_allclose(out[:40], want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(final, want_state, atol=2e-5, rtol=2e-5)


def test_state_carries_across_calls():
    q, k, v, g, beta, state = random_inputs(32, seed=1)
    whole, whole_state = chunked_gated_delta(q, k, v, g, beta, state, 8)
    first, mid = chunked_gated_delta(q[:16], k[:16], v[:16], g[:16], beta[:16], state, 8)
    second, end = chunked_gated_delta(q[16:], k[16:], v[16:], g[16:], beta[16:], mid, 16)
    np.testing.assert_allclose(jnp.concatenate([first, second]), whole, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(end, whole_state, atol=2e-5, rtol=2e-5)


def test_both_forms_lower_for_cuda():
    """The GPU path is these same functions (a scan over chunks, XLA's triangular solve): they lower
    for CUDA without a GPU (as tests/kernels/ lowers the Pallas kernels)."""
    q, k, v, g, beta, state = random_inputs(64)
    chunked = jax.jit(chunked_gated_delta, static_argnums=6).trace(q, k, v, g, beta, state, 16)
    assert "triangular_solve" in chunked.lower(lowering_platforms=("cuda",)).as_text()
    one = jax.jit(recurrent_gated_delta).trace(q[:2], k[:2], v[:2], g[:2], beta[:2], jnp.stack([state, state]))
    assert one.lower(lowering_platforms=("cuda",)).as_text()
