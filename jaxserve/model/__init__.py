"""The Flax model: a decoder over a paged KV cache, for every family in `checkpoints/architectures/`."""

from jaxserve.model.decoder_model import DecoderModel
from jaxserve.model.kv_cache import AttentionMetadata, KVCache

__all__ = ["AttentionMetadata", "DecoderModel", "KVCache"]
