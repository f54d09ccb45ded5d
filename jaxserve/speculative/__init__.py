"""Speculative decoding: its settings, the `Proposer` interface that drafts tokens (n-gram prompt lookup
today; host side, no JAX), and the device-side verification of the drafts (`jaxserve.speculative.verify`,
which imports JAX and is loaded by the runner only)."""

from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.ngram import propose_ngram
from jaxserve.speculative.proposer import NgramProposer, Proposer, build_proposer

__all__ = ["NgramProposer", "Proposer", "SpeculativeConfig", "build_proposer", "propose_ngram"]
