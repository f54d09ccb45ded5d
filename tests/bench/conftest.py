"""Fixtures of the bench tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> str:
    """A persistent JAX compilation cache shared by every server and engine the bench tests start."""
    return str(tmp_path_factory.mktemp("bench-jax-compilation-cache"))
