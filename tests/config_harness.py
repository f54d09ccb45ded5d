"""Resolved engine configs for host-only tests (scheduler, step inputs): no model is built, so no JAX."""

from __future__ import annotations

from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.resolved_config import ResolvedConfig, ServedModel, resolve_limits

# A model of a long context with float32 KV blocks of 1 KiB: a test's max_model_len is kept as given (such
# tests build their KV manager themselves, of the size they need).
HOST_ONLY_MODEL = ServedModel(
    context=1 << 20,
    dtype="float32",
    attention_backend="reference",
    kv_storage_dtype="float32",
    kv_block_bytes=1 << 10,
    kv_devices=1,
)


def resolved(**settings: Any) -> ResolvedConfig:
    """`EngineConfig(**settings)` resolved for `HOST_ONLY_MODEL`."""
    return resolve_limits(EngineConfig(**settings), HOST_ONLY_MODEL)
