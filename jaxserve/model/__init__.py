"""The Flax model: a Llama-family decoder over a paged KV cache."""

from jaxserve.model.llama import AttentionMetadata, KVCache, LlamaModel

__all__ = ["AttentionMetadata", "KVCache", "LlamaModel"]
