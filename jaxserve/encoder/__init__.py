"""Serving encoder embedding models (BERT family): `EncoderEngine`, an engine replica whose steps
run batches of whole inputs through a compiled encoder (no KV cache, no generation)."""

from jaxserve.encoder.engine import EncoderEngine

__all__ = ["EncoderEngine"]
