"""N-gram (prompt lookup) speculative decoding: its settings and the draft proposer (host side,
no JAX), and the device-side verification of the drafts (`jaxserve.speculative.verify`, which
imports JAX and is loaded by the runner only)."""

from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "propose_ngram"]
