"""The draft length of each step: the k in {0, 1, ..., K} (K = `num_speculative_tokens`) that maximizes the
expected tokens per second under a cost model measured online; k = 0 is a plain decode step (drafting off).

The cost model, per batch bucket b (the running batch rounded up to a power of two) and per sequence:

- acceptance a_i = P(draft token i accepted | drafts 1 .. i - 1 accepted), i = 1 .. K. The counts are the
  engine's (`StepStats.position_drafts` / `position_accepted`, the ones /metrics shows): position j counts a
  draft with a token there, and an acceptance when its first j + 1 tokens were all accepted, so their ratio is
  prod_{i <= j+1} a_i. This model keeps only a decayed sum of their increments (old workloads fade).
- tokens of a step drafting k: E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i (the accepted drafts, plus the token
  after them: the bonus); E(0) = 1.
- time: T(k) = draft(k) + verify_b(k), T(0) = decode_b. draft(k) = k c_b, with c_b the proposer's drafting
  seconds per draft token at the bucket (catch-up included); verify_b the rest of a speculative step (launch,
  verify, read). The verify program has K + 1 rows per sequence whatever k (one compiled shape per bucket),
  so verify_b(k) is one figure per bucket; the draft chain's length is an input of its one compiled program
  (`draft_programs.chain_drafts`), so no k compiles anything. decode_b: a plain decode step (a multi-step
  loop's time over its steps).
- choice: k* = argmax_k E(k) / T(k) (ties to the smaller k).

Step times are the engine's (`observe`: a step's scheduling, drafting, launch and read, not the read of the
step in flight before it): only decode-only steps are measured, and a plain one only when the step before it
was plain too (in the overlapped loop a step's time is then one device step). Each figure is an exponential
average, so it follows the load. Host work between steps (outside `LLMEngine.step`) is not in them.

Probing: while an estimate of the bucket is missing, steps measure it (K first, then 0). Then every
`interval` steps at the bucket a probe runs the other extreme: K while the choice is below K (acceptance at
every position, draft and verify time measured again: drafting turns back on when it would pay), else three
plain steps (the first one follows a speculative step: not measured). A probe's step times weigh PROBE_WEIGHT
in their averages (other steps WEIGHT): the option not chosen is measured by probes alone. A probe that leaves
the choice as it was doubles the interval, from MIN_INTERVAL up to MAX_INTERVAL; one that changes it starts
again from MIN_INTERVAL.

With `adaptive_draft_length` off the choice is K always (a pinned k, for benchmarks). Either way the choices
are counted for /metrics (`chosen_tokens` over `decode_steps`: the mean draft length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.scheduler.output import SchedulerOutput

MIN_INTERVAL = 8  # steps between probes at a bucket, at first
MAX_INTERVAL = 64  # at most: the option not chosen is measured by probes alone, and the load changes
DECAY = 0.9  # of the acceptance counts, per speculative step measured
WEIGHT = 0.25  # of a new step time in its exponential average
PROBE_WEIGHT = 0.5  # of a probe step's: the option not chosen is measured by probes alone
PLAIN_PROBE = 3  # plain steps in a probe of k = 0 (the first one follows a speculative step: not measured)


@dataclasses.dataclass
class BucketCosts:
    """A bucket's measured times (None: not measured yet) and its probe schedule."""

    decode: float | None = None  # seconds of a plain decode step
    verify: float | None = None  # seconds of a speculative step less its drafting
    per_draft_token: float | None = None  # drafting seconds per draft token
    steps: int = 0  # steps since the last probe
    interval: int = MIN_INTERVAL
    probe: int | None = None  # the k of the probe under way
    probe_steps: int = 0  # its steps left
    before_probe: int = 0  # the choice when it started


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def bucket_of(batch: int) -> int:
    """The batch rounded up to a power of two."""
    return 1 << max(batch - 1, 0).bit_length()


class DraftLength:
    """The cost model and the choice of k (see the module docstring); one per proposer."""

    def __init__(self, max_tokens: int, adaptive: bool = True) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.buckets: dict[int, BucketCosts] = {}
        self.drafted = [0.0] * max_tokens  # decayed counts per draft position
        self.accepted = [0.0] * max_tokens
        self._seen: tuple[Sequence[int], ...] = ([], [])  # the engine's counts at the last update
        self._draft_seconds = 0.0  # the proposer's total at the last step observed
        self._last: tuple[int, int] | None = None  # (bucket, k) of the choice since the last step observed
        self._previous_plain = False
        self.chosen_tokens = 0  # k chosen, summed over decode steps
        self.decode_steps = 0

    # ----- the model ------------------------------------------------------------------------

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a sequence gets from a step drafting k."""
        return 1.0 + sum(self.accepted[j] / self.drafted[j] for j in range(k) if self.drafted[j] > 0)

    def rate(self, costs: BucketCosts, k: int) -> float | None:
        """E(k) / T(k), tokens per second per sequence; None while a time it needs is not measured."""
        if k == 0:
            return None if costs.decode is None else 1.0 / costs.decode
        if costs.verify is None or costs.per_draft_token is None:
            return None
        return self.expected_tokens(k) / (k * costs.per_draft_token + costs.verify)

    def best(self, costs: BucketCosts) -> int | None:
        """k*, or None while an estimate is missing."""
        rates = [self.rate(costs, k) for k in range(self.max_tokens + 1)]
        if any(r is None for r in rates):
            return None
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    # ----- the choice -----------------------------------------------------------------------

    def choose(self, num_running: int) -> int:
        """The k of the next step with `num_running` requests running (the same until `observe`)."""
        bucket = bucket_of(num_running)
        costs = self.buckets.setdefault(bucket, BucketCosts())
        if not self.adaptive:
            k = self.max_tokens
        elif costs.probe is not None:
            k = costs.probe
        else:
            best = self.best(costs)
            if best is None:  # measure what is missing: K first, then a plain step
                k = self.max_tokens if costs.verify is None or costs.per_draft_token is None else 0
            else:
                k = best
        self._last = (bucket, k)
        return k

    def observe(
        self, sched: SchedulerOutput, seconds: float, draft_seconds: float, counts: tuple[Sequence[int], ...]
    ) -> None:
        """A step ran (`seconds`: its time, see the module docstring): measure it if it is a decode-only step,
        take the engine's acceptance `counts` (position_drafts, position_accepted), move the probe schedule on.
        `draft_seconds`: the proposer's drafting seconds so far. A step no choice was made for (more running
        than `disable_by_batch_size`, an n-gram pause) counts as k = 0 and is not measured."""
        drafting, self._draft_seconds = draft_seconds - self._draft_seconds, draft_seconds
        last, self._last = self._last, None
        if not sched.decodes:
            return
        self.decode_steps += 1
        if last is None:
            self._previous_plain = False
            return
        bucket, k = last
        self.chosen_tokens += k
        costs = self.buckets[bucket]
        speculative = sched.is_speculative
        weight = WEIGHT if costs.probe is None else PROBE_WEIGHT
        if not sched.prefills:
            if speculative:
                costs.per_draft_token = _average(costs.per_draft_token, drafting / k, weight)
                costs.verify = _average(costs.verify, max(seconds - drafting, 0.0), weight)
            elif self._previous_plain:
                costs.decode = _average(costs.decode, seconds / max(c.num_steps for c in sched.decodes), weight)
        self._previous_plain = not speculative and not sched.prefills
        if speculative:
            self._take_counts(*counts)
        if self.adaptive:
            self._schedule_probe(costs, k)

    def _take_counts(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Decay the counts, then add the engine's increments since the last time."""
        seen_drafted, seen_accepted = self._seen
        for j in range(min(self.max_tokens, len(drafted))):
            new_d = drafted[j] - (seen_drafted[j] if j < len(seen_drafted) else 0)
            new_a = accepted[j] - (seen_accepted[j] if j < len(seen_accepted) else 0)
            self.drafted[j] = DECAY * self.drafted[j] + new_d
            self.accepted[j] = DECAY * self.accepted[j] + new_a
        self._seen = (list(drafted), list(accepted))

    def _schedule_probe(self, costs: BucketCosts, k: int) -> None:
        """Count the step towards the bucket's next probe; end a probe that ran its steps, starting one when due."""
        if costs.probe is not None:
            if k == costs.probe:
                costs.probe_steps -= 1
            if costs.probe_steps > 0:
                return
            costs.probe = None
            settled = self.best(costs) == costs.before_probe
            costs.interval = min(2 * costs.interval, MAX_INTERVAL) if settled else MIN_INTERVAL
            return
        best = self.best(costs)
        costs.steps += 1
        if best is None or costs.steps < costs.interval:
            return
        costs.steps = 0
        costs.probe = self.max_tokens if best < self.max_tokens else 0
        costs.probe_steps = 1 if costs.probe else PLAIN_PROBE
        costs.before_probe = best
