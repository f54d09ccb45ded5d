"""The benchmark's view of a model spec: its tokenizer (to build workloads) and its GGUF file (for peers)."""

from __future__ import annotations

from pathlib import Path

from checkpoints.registry import REGISTERED_GGUF, fetch_gguf, load_model
from jaxserve.tokenizer import Tokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """The model's tokenizer (loads the checkpoint once; the weights are dropped right after)."""
    return Tokenizer(load_model(spec).tokenizer_bundle)


def special_token_ids(tokenizer: Tokenizer) -> set[int]:
    return set(tokenizer.bundle.tokenizer.get_added_tokens_decoder())


def gguf_path(spec: str) -> Path:
    """The GGUF file peers load, so that they run the very same weights as jaxserve."""
    if spec in REGISTERED_GGUF:
        return fetch_gguf(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ValueError(f"peers load GGUF files: {spec!r} is neither a registered GGUF model nor a .gguf file")


def encoder_dir(spec: str) -> Path:
    """The sentence-transformers directory of an encoder embedding model (a registered name or a path)."""
    from checkpoints.encoders.fetch import ENCODER_MODELS, fetch_encoder

    path = fetch_encoder(spec) if spec in ENCODER_MODELS else Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"the sentence-transformers peer loads a directory: {spec!r} is not one")
    return path
