"""The ends of the decoder: the token embedding, and the final norm and output head that turn
last hidden states into logits (in the model, and from sown hidden states: `head_logits`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from checkpoints.architectures import declare
from checkpoints.config import ModelConfig
from checkpoints.quant_format import SCALE
from checkpoints.weights import Weight, flat
from jaxserve.model.linear import Linear, matmul
from jaxserve.model.norm import RMSNorm
from jaxserve.model.quantized import QuantizedEmbed, stored_matmul
from kernels_pallas.cpu_matmul import CpuMatmul


def embedding(
    config: ModelConfig, weights: dict[str, Weight], dtype: Any, param_dtype: Any, cpu_matmul: CpuMatmul | None
) -> nn.Module:
    """The token embedding (a child `embed` of the module whose `__call__` calls this), rows in
    `dtype`: a table, or a tied table stored quantized as the head's kernel (`QuantizedEmbed`)."""
    if "embed/kernel" in weights:
        return QuantizedEmbed(weights["embed/kernel"], dtype, param_dtype, cpu_matmul, name="embed")
    return nn.Embed(
        config.vocab_size,
        config.hidden_size,
        dtype=dtype,
        param_dtype=param_dtype,
        embedding_init=weights["embed/embedding"].flax_init(),
        name="embed",
    )


def output_head(
    config: ModelConfig,
    weights: dict[str, Weight],
    embed: nn.Module,
    h: jax.Array,
    logits_indices: jax.Array,
    param_dtype: Any,
    cpu_matmul: CpuMatmul | None,
) -> jax.Array:
    """f32 logits [N, V] of final-normed rows h [N, E] (the rows at `logits_indices`; -1: padding
    after the live ones): through the embedding where tied (on the C++ head where `cpu_matmul`
    takes it), else the head kernel (`lm_head`, a child of the caller's module)."""
    if isinstance(embed, QuantizedEmbed):
        return embed.attend(h)
    if config.tie_word_embeddings and cpu_matmul is not None and cpu_matmul.takes_head(h, embed.embedding):
        # Padding rows (index -1, after the live ones: `StepInputs.prefill`) are not computed.
        return cpu_matmul.head(h, embed.embedding, jnp.sum(logits_indices >= 0))
    if config.tie_word_embeddings:
        return matmul(h, embed.embedding, contract_w=1)
    # a quantized head on the C++ kernel where one is given (in panels: `panel_kernels`)
    return Linear(weights["lm_head/kernel"], None, jnp.float32, param_dtype, cpu_matmul=cpu_matmul, name="lm_head")(h)


def final_norm(config: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """The model's final norm of last hidden states (the `hidden` rows `DecoderModel` sows), with its
    parameters: what the output head reads, and what embeddings pool."""
    norm = RMSNorm(flat(declare(config))["final_norm/scale"], config.rms_norm_eps, hidden.dtype)
    return norm.apply({"params": params["final_norm"]}, hidden)


def head_logits(config: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """f32 logits of last hidden states (the `hidden` rows `DecoderModel` sows): its final norm
    and output head, with its parameters."""
    x = final_norm(config, params, hidden)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    if SCALE in head:  # quantized (`--quantization`)
        return stored_matmul(x, head, None, x.dtype)
    if config.tie_word_embeddings:
        return matmul(x, head["embedding"], contract_w=1)
    return matmul(x, head["kernel"])
