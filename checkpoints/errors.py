"""Exceptions raised by the checkpoint loaders.

A missing file is a plain `FileNotFoundError`; everything else the loaders reject is a
`CheckpointError`, so callers (the CLI, the server) can report it without a traceback.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint exists but cannot be read: truncated, corrupted or inconsistent."""


class UnsupportedCheckpointError(CheckpointError):
    """A well-formed checkpoint of an architecture, quantization or tokenizer we do not support."""


class ModelFetchError(CheckpointError):
    """A registered model could not be downloaded (no network, package index error, ...)."""
