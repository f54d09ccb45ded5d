"""Speculative decoding: its settings, the `Proposer` interface that drafts tokens (n-gram prompt lookup on
the host, no JAX; a draft model, `draft_model`, DeepSeek-V3's MTP layer, `mtp_proposer`, and an EAGLE-3 head,
`eagle3_proposer`, which import JAX and are built by the engine), and the device-side verification of the
drafts (`jaxserve.speculative.verify`, which imports JAX and is loaded by the runner only)."""

from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.ngram import propose_ngram
from jaxserve.speculative.proposer import NgramProposer, Proposer, build_proposer

__all__ = ["NgramProposer", "Proposer", "SpeculativeConfig", "build_proposer", "propose_ngram"]
