"""The Gated DeltaNet block of a hybrid's linear-attention layers (Qwen3.5, Qwen3-Next), an
`AttentionBlock` over the `LinearStateCache`: projections, causal depthwise conv, the gated
delta rule (`gated_delta_rule.py`), the output norm gated by z, and the output projection.

A step's rows are ragged (`AttentionMetadata`): the chunks of the first P sequences, then (in a
prefill step) one row per decode. Each chunk runs the chunked form over a window of the step's
rows from its first (its rows past its length masked: they leave the state as it is), all chunks
at once (vmapped); the decodes run the recurrent form, one token each. A sequence reads its
state from its state slot and writes it back; one whose chunk starts at position 0 starts from
zeros (a new prompt, or one recomputed after preemption).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.config import ModelConfig
from checkpoints.weights import LAYERS, Weight
from jaxserve.model.gated_delta_rule import CHUNK, causal_conv, chunked_gated_delta, normed_qk, recurrent_gated_delta
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.layer_scope import LayerScope
from jaxserve.model.rope import RopeTables
from jaxserve.model.state_cache import STATE_DTYPE, LinearStateCache
from kernels_pallas import AttentionBackend


class DeclaredParams(nn.Module):
    """The declared parameters `weights` ({leaf name: Weight}) of one submodule, read whole and
    indexed by `layer` where stacked."""

    weights: dict[str, Weight]
    param_dtype: Any

    @nn.compact
    def __call__(self, layer: jax.Array) -> dict[str, jax.Array]:
        out = {}
        for name, w in self.weights.items():
            value = self.param(name, w.flax_init(), w.shape, w.dtype(self.param_dtype))
            out[name] = value[layer] if w.axes[0] == LAYERS else value
        return out


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The delta rule's inputs of a step's rows (f32): conv inputs x [T, C], z [T, H_v, d_v] and the
    per-head g, beta [T, H_v]."""

    x: jax.Array
    z: jax.Array
    g: jax.Array
    beta: jax.Array


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    config: ModelConfig
    backend: AttentionBackend
    param_dtype: Any

    def __call__(
        self, scope: LayerScope, x: jax.Array, cache: LinearStateCache, rope: RopeTables, meta: AttentionMetadata
    ) -> tuple[jax.Array, LinearStateCache]:
        layer = scope.layer
        names = {p.split("/", 1)[1]: w for p, w in scope.weights.items() if p.startswith("gated_delta/")}
        params = DeclaredParams(names, self.param_dtype, name="gated_delta")(layer)
        inputs = self._inputs(scope, x, params)
        weight = params["conv1d"].astype(jnp.float32)
        slots = meta.state_slots
        conv, recurrent = cache.conv[layer][slots], cache.recurrent[layer][slots]  # [S, ...]
        fresh = _first_positions(meta) <= 0
        conv = jnp.where(fresh[:, None, None], 0.0, conv)
        recurrent = jnp.where(fresh[:, None, None, None], 0.0, recurrent)
        if meta.query_start is None:
            out, conv, recurrent = self._decodes(inputs, jnp.arange(x.shape[0]), weight, conv, recurrent)
        else:
            out, conv, recurrent = self._prefill(inputs, meta, weight, conv, recurrent)
        cache = dataclasses.replace(
            cache,
            conv=cache.conv.at[layer, slots].set(conv.astype(STATE_DTYPE)),
            recurrent=cache.recurrent.at[layer, slots].set(recurrent.astype(STATE_DTYPE)),
        )
        normed = scope.norm("linear_norm", out) * jax.nn.silu(inputs.z)
        return scope.dense("out_proj", normed.reshape(x.shape[0], -1).astype(scope.dtype)), cache

    def _inputs(self, scope: LayerScope, x: jax.Array, params: dict[str, jax.Array]) -> Inputs:
        cfg, t = self.config, x.shape[0]
        qkv, z, b, a = self._projections(scope, x)
        z = z.reshape(t, cfg.linear_num_value_heads, cfg.linear_value_head_dim).astype(jnp.float32)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(params["A_log"].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + params["dt_bias"])
        return Inputs(qkv.astype(jnp.float32), z, g, beta)

    def _projections(self, scope: LayerScope, x: jax.Array) -> tuple[jax.Array, ...]:
        """qkv [T, C] (queries, keys, values: the conv's channels), z [T, H_v d_v], b, a [T, H_v]: from
        Qwen3.5's four projections, or Qwen3-Next's two fused by key head (`in_proj_qkvz`, `in_proj_ba`)."""
        if "in_proj_qkvz/kernel" not in scope.weights:
            return tuple(scope.dense(f"in_proj_{name}", x) for name in ("qkv", "z", "b", "a"))
        cfg, t = self.config, x.shape[0]
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        per_key = cfg.linear_num_value_heads // hk
        width = per_key * cfg.linear_value_head_dim
        qkvz = scope.dense("in_proj_qkvz", x).reshape(t, hk, -1)
        q, k, v, z = (
            qkvz[..., i:j] for i, j in ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + width), (2 * dk + width, None))
        )
        ba = scope.dense("in_proj_ba", x).reshape(t, hk, 2 * per_key)
        shards = cfg.linear_shards  # each shard's queries, keys, values together (`_split`)
        qkv = jnp.concatenate([part.reshape(t, shards, -1) for part in (q, k, v)], axis=-1).reshape(t, -1)
        return qkv, z.reshape(t, -1), ba[..., :per_key].reshape(t, -1), ba[..., per_key:].reshape(t, -1)

    def _split(self, mixed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Conv outputs [..., C] -> q, k [..., H_v, d_k] (normed) and v [..., H_v, d_v]. The channels are
        `linear_shards` groups of [queries, keys, values] of their key heads (`sharding.linear_heads`:
        one group, the checkpoints' order, on one device)."""
        cfg = self.config
        lead = mixed.shape[:-1]
        grouped = mixed.reshape(*lead, cfg.linear_shards, -1)
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim // cfg.linear_shards
        q = grouped[..., :key].reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = grouped[..., key : 2 * key].reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        v = grouped[..., 2 * key :].reshape(*lead, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        q, k = normed_qk(q, k, cfg.linear_num_value_heads)
        return q, k, v

    def _decodes(
        self, inputs: Inputs, rows: jax.Array, weight: jax.Array, conv: jax.Array, recurrent: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One token per sequence at `rows` (out of range: padding): the recurrent form. Returns
        the outputs of every row [T, H_v, d_v] (zeros but at `rows`) and the sequences' states."""
        t = inputs.x.shape[0]
        at = jnp.minimum(rows, t - 1)
        window = jnp.concatenate([conv, inputs.x[at][:, None]], axis=1)  # [S, K, C]
        mixed = jax.nn.silu(jnp.einsum("skc,ck->sc", window, weight))
        q, k, v = self._split(mixed)
        out, recurrent = recurrent_gated_delta(q, k, v, inputs.g[at], inputs.beta[at], recurrent)
        full = jnp.zeros((t, *out.shape[1:]), out.dtype).at[rows].set(out, mode="drop")
        return full, window[:, 1:], recurrent

    def _prefill(
        self, inputs: Inputs, meta: AttentionMetadata, weight: jax.Array, conv: jax.Array, recurrent: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The chunks of the first P sequences (chunked form), then the decodes of a prefill step."""
        t = inputs.x.shape[0]
        p = meta.query_start.shape[0] - 1
        window = -(-t // CHUNK) * CHUNK if t > CHUNK else t
        starts, lengths = meta.query_start[:-1], meta.query_start[1:] - meta.query_start[:-1]

        def padded(a: jax.Array) -> jax.Array:
            return jnp.pad(a, ((0, window),) + ((0, 0),) * (a.ndim - 1))

        x, g, beta = padded(inputs.x), padded(inputs.g), padded(inputs.beta)

        def chunk(start, length, conv, state):
            take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, window)  # noqa: E731
            real = jnp.arange(window) < length
            mixed, conv = causal_conv(take(x), conv, weight, length)
            q, k, v = self._split(mixed)
            k = jnp.where(real[:, None, None], k, 0.0)
            g_c, beta_c = (jnp.where(real[:, None], take(a), 0.0) for a in (g, beta))
            out, state = chunked_gated_delta(q, k, v, g_c, beta_c, state, min(CHUNK, window))
            return jnp.where(real[:, None, None], out, 0.0), conv, state

        outs, chunk_conv, chunk_state = jax.vmap(chunk)(starts, lengths, conv[:p], recurrent[:p])
        rows = starts[:, None] + jnp.arange(window)[None, :]
        out = jnp.zeros((t + window, *outs.shape[2:]), outs.dtype).at[rows].add(outs)[:t]
        conv, recurrent = conv.at[:p].set(chunk_conv), recurrent.at[:p].set(chunk_state)
        if meta.decode_rows is None:
            return out, conv, recurrent
        decoded, dec_conv, dec_state = self._decodes(inputs, meta.decode_rows, weight, conv[p:], recurrent[p:])
        return out + decoded, conv.at[p:].set(dec_conv), recurrent.at[p:].set(dec_state)


def _first_positions(meta: AttentionMetadata) -> jax.Array:
    """[S] the position of each sequence's first new token in the step (<= 0: it starts afresh)."""
    if meta.query_start is None:
        return meta.seq_lens - 1
    p = meta.query_start.shape[0] - 1
    chunk_lengths = meta.query_start[1:] - meta.query_start[:-1]
    return jnp.concatenate([meta.seq_lens[:p] - chunk_lengths, meta.seq_lens[p:] - 1])
