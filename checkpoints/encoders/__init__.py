"""Encoder embedding models (BERT family): their configuration, declared weights and loaders.

Kept apart from the decoder families of `checkpoints/architectures/`: an encoder has no LM head,
no KV cache and no chat template, and is served by `jaxserve.encoder`, not the decoder engine.
"""

from checkpoints.encoders.config import EncoderConfig
from checkpoints.encoders.load import ENCODER_MODELS, is_encoder_spec, load_encoder

__all__ = ["ENCODER_MODELS", "EncoderConfig", "is_encoder_spec", "load_encoder"]
