"""A reference of the MTP formula (`jaxserve.speculative.mtp_model`) that the MTP tests check drafts against:
numpy for the norms, the projection and the head, the model's own decoder layer (the MTP's `LayerStack`) run
over every position in one causal pass from a fresh cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import AttentionMetadata, KVCache
from jaxserve.model.rope import rope_tables

REFERENCE_ROWS = 128  # the reference's one causal pass, padded (rows past the sequence change none before)
_JITTED: dict[int, object] = {}  # the reference layer compiled, by stack


def _rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _one(x: np.ndarray, ndim: int) -> np.ndarray:
    return x[0] if x.ndim > ndim else x


def _reference_layer(stack, params, x):
    """The MTP's decoder layer over REFERENCE_ROWS positions of one sequence, from a fresh cache."""
    n, bs = REFERENCE_ROWS, 8
    cache = KVCache.zeros(stack.config, 1 + n // bs, bs, jnp.float32)
    positions = jnp.arange(n, dtype=jnp.int32)
    table = jnp.arange(1, 1 + n // bs, dtype=jnp.int32)[None]
    meta = AttentionMetadata(positions + bs, table, jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32))
    layer = stack.scanned(1, parent=None)
    (h, _), _ = layer.apply(
        {"params": params}, (x, cache), jnp.arange(1), rope_tables(stack.config, positions), meta, None
    )
    return h


def reference_chain(stack, params, hidden: np.ndarray, tokens: list[int], k: int) -> list[int]:
    return reference_logits(stack, params, hidden, tokens, k)[0]


def reference_logits(stack, params, hidden: np.ndarray, tokens: list[int], k: int) -> tuple[list[int], np.ndarray]:
    """Greedy drafts of the MTP formula after `tokens` (N of them), from the target's hidden states `hidden`
    [N - 1, E] of positions 0 .. N - 2: each draft recomputes every MTP position from scratch (position p: the
    token after it and the state at p: the target's, final-normed;
    past N - 2 the draft before it and the state the layer gave at p - 1: its output (DeepSeek-V3) or head_norm
    of it). `params`: `mtp_params` of a target's; `stack`: the MTP layer's. Returns
    the drafts and the logits [k, V] each was the argmax of (`reference_chain`: the drafts)."""
    p = jax.tree.map(np.asarray, params)
    m, eps = p["mtp"], stack.config.rms_norm_eps
    table = _one(p["embedding"], 2)
    head = _one(p["head"], 2) if "head" in p else table.T
    feeds_normed = not stack.config.is_mla  # DeepSeek-V3's chain feeds the layer's output back
    layer = _JITTED.setdefault(id(stack), jax.jit(functools.partial(_reference_layer, stack)))
    drafts: list[int] = []
    logits = []
    states = [_rms(h, p["hidden_norm"], eps) for h in np.asarray(hidden, np.float32)]
    for _ in range(k):
        n = len(states)
        embedded = table[np.asarray((list(tokens[1:]) + drafts)[:n])]
        if stack.config.is_mla:
            embedded[0] = 0.0  # DeepSeek-V3: position 0's embedding is masked
        x = np.concatenate(
            [
                _rms(embedded, _one(m["enorm"]["scale"], 1), eps),
                _rms(np.stack(states), _one(m["hnorm"]["scale"], 1), eps),
            ],
            axis=1,
        )
        x = np.pad(x @ _one(m["eh_proj"]["kernel"], 2), ((0, REFERENCE_ROWS - n), (0, 0)))
        out = np.asarray(layer(params["mtp"]["layer"], jnp.asarray(x, jnp.float32)))[n - 1]
        out_normed = _rms(out, _one(m["head_norm"]["scale"], 1), eps)
        logits.append(out_normed @ head)
        drafts.append(int(np.argmax(logits[-1])))
        states.append(out_normed if feeds_normed else out)
    return drafts, np.stack(logits)
