"""The proposer interface: where draft tokens come from, for the scheduler to verify.

Before each step the scheduler hands the proposer the decodes it may run (`Proposer.propose`) and gets
back the draft tokens of those it drafts for; it then only reserves KV slots for 1 + len(draft) tokens to
verify per decode (under its token budget), and releases the slots of rejected drafts when the step is read.
How drafts are made (n-gram lookup, a draft model, the target's MTP layer, an EAGLE-3 head) is the proposer's
alone. A proposer that keeps state per request (a draft model's KV cache) drops it when the scheduler `release`s
the request (finished, aborted, failed or preempted). One that `wants_hidden` (MTP, EAGLE-3) is given the
target's hidden states (the last ones; EAGLE-3's aux layers') of every step the engine reads (`take_hidden`).

`NgramProposer` (prompt lookup, `jaxserve.speculative.ngram`), `DraftModelProposer`
(`jaxserve.speculative.draft_model`) and `MtpProposer` (`jaxserve.speculative.mtp_proposer`; both import JAX
and are built by the engine) implement it;
`build_proposer` builds the configured one from `SpeculativeConfig` (None: speculation off).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jaxserve.request import PLACEHOLDER, Request
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.draft_length import DraftLength
from jaxserve.speculative.hidden_rows import HiddenRows
from jaxserve.speculative.ngram import propose_ngram

MAX_PAUSE = 16  # steps without drafting after draftless ones, at most


class Proposer(Protocol):
    """Draft tokens for decodes, verified by the target model in one step (`jaxserve.speculative.verify`)."""

    # Each step's draft length (0: no drafting), from a cost model the engine feeds (`DraftLength.observe`).
    draft_length: DraftLength

    def may_propose(self, num_running: int) -> bool:
        """Whether the next step may carry drafts with `num_running` requests running. While it may, the
        engine reads the step in flight before scheduling: a draft continues every known token."""
        ...

    def propose(self, decodes: Sequence[Request], num_running: int) -> dict[Request, list[int]] | None:
        """The drafts of the decodes it looked up (a draft may be []: looked up, none found), each at most
        as long as its request may still generate; a decode absent was not looked up. None: no drafting
        this step (it may run multi-step decode instead)."""
        ...

    def on_scheduled(self, looked_up: bool, drafted: bool) -> None:
        """The step is scheduled: some scheduled decode was `looked_up`, and some carries a draft
        (`drafted`; a decode without room for its draft's slots runs without it)."""
        ...

    def draft_probs(self, request: Request) -> np.ndarray | None:
        """q [len(draft), V]: the distribution each token of the request's last draft was drawn from (a draft
        model at temperature > 0), for rejection sampling; None: the draft is deterministic."""
        ...

    def release(self, request: Request) -> None:
        """The request left the running batch (finished, aborted, failed or preempted): drop what the
        proposer keeps for it (a draft model's KV blocks)."""
        ...

    @property
    def wants_hidden(self) -> bool:
        """Whether it drafts from the target's last hidden states (MTP): the runner then reads them off every
        step, and the engine hands them over (`take_hidden`) as it reads each step."""
        ...

    def take_hidden(self, rows: Sequence[HiddenRows]) -> None:
        """A read step's hidden states of the positions whose tokens stand (only when `wants_hidden`)."""
        ...

    def warm_up(self) -> None:
        """Compile what drafting runs on the device (nothing for a host-side proposer)."""
        ...

    @property
    def num_compilations(self) -> int:
        """Compilations of the proposer's own device programs so far."""
        ...

    @property
    def draft_seconds(self) -> float:
        """Wall-clock seconds spent drafting so far (`propose`)."""
        ...


class NgramProposer:
    """Prompt lookup (`propose_ngram`) with the pause after draftless steps: a step that looked for drafts
    and found none pauses drafting for 1, 2, 4 ... steps (at most MAX_PAUSE), so a batch whose text does not
    repeat keeps async scheduling's overlap most of the time; a step with a draft ends the pause."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int):
        self.spec = spec
        self.max_model_len = max_model_len
        self.draft_length = DraftLength(spec.num_speculative_tokens, spec.adaptive_draft_length)
        self._backoff = 0  # length of the last pause (0: the last step that looked up drafted)
        self._pause = 0  # steps left to schedule without drafting
        self.draft_seconds = 0.0

    def may_propose(self, num_running: int) -> bool:
        """No pause after draftless steps, at most `disable_by_batch_size` running, and a draft length chosen."""
        return (
            not self._pause
            and num_running <= self.spec.disable_by_batch_size
            and self.draft_length.choose(num_running) > 0
        )

    def propose(self, decodes: Sequence[Request], num_running: int) -> dict[Request, list[int]] | None:
        """None unless `may_propose` and every decode's context has room for a verify step (k + 1
        positions from its last token); then a draft per decode that may get one (`_draft`)."""
        room = self.max_model_len - self.spec.num_speculative_tokens
        if not decodes or not self.may_propose(num_running) or any(r.num_tokens > room for r in decodes):
            return None
        t0 = time.perf_counter()
        k = self.draft_length.choose(num_running)
        drafts = {req: self._draft(req, k) for req in decodes}
        self.draft_seconds += time.perf_counter() - t0
        return {req: draft for req, draft in drafts.items() if draft is not None}

    def _draft(self, req: Request, k: int) -> list[int] | None:
        """The request's n-gram draft of at most `k` tokens and as many as it may still generate ([] if its
        tokens hold none); None, not looked up, for a constrained request (its next masks depend on each
        token), one with a token in flight, or one with no token left to draft."""
        spec = self.spec
        k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0 or req.grammar is not None or PLACEHOLDER in req.output_token_ids[-1:]:
            return None
        return propose_ngram(req.copy_tokens(), k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def on_scheduled(self, looked_up: bool, drafted: bool) -> None:
        if looked_up:
            self._backoff = 0 if drafted else min(max(1, 2 * self._backoff), MAX_PAUSE)
            self._pause = self._backoff
        elif self._pause:
            self._pause -= 1

    def draft_probs(self, request: Request) -> None:
        """None: a looked-up draft is deterministic."""

    def release(self, request: Request) -> None:
        """Nothing kept per request."""

    wants_hidden = False

    def take_hidden(self, rows: Sequence[HiddenRows]) -> None:
        """Nothing: the lookup reads tokens only."""

    def warm_up(self) -> None:
        """Nothing to compile: the lookup runs on the host."""

    num_compilations = 0


def build_proposer(
    spec: SpeculativeConfig | None,
    max_model_len: int,
    load_draft: Callable[[SpeculativeConfig], Proposer] | None = None,
) -> Proposer | None:
    """The configured proposer (None: speculation off). Methods not served are refused by
    `SpeculativeConfig` itself. "draft_model", "mtp" and "eagle3" are built by `load_draft` (the engine's: it
    loads the draft model next to the target, `jaxserve.speculative.draft_loading.load_draft_proposer`, builds
    the target's MTP layer, `jaxserve.speculative.mtp_proposer.build_mtp_proposer`, or loads an EAGLE-3 head,
    `jaxserve.speculative.eagle3_proposer.build_eagle3_proposer`)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec, max_model_len)
    if spec.method in ("draft_model", "mtp", "eagle3") and load_draft is not None:
        return load_draft(spec)
    raise ValueError(f"no proposer for speculative method {spec.method!r}")
