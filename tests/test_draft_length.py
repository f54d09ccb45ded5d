"""The adaptive draft length's cost model (`jaxserve.speculative.draft_length`, host only): fed step times and
acceptance counts as the engine feeds them, it measures what it lacks first, picks 0 where drafting costs more
than it saves, the longest draft where acceptance is high and drafts are cheap, a length in between where
acceptance falls along the draft, probes again on a doubling interval, and turns drafting back on once probes
show it pays; pinned, it always drafts the most."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.speculative.draft_length import MAX_INTERVAL, MIN_INTERVAL, DraftLength, bucket_of

K = 4


def step(speculative: bool, prefill: bool = False, num_steps: int = 1) -> SimpleNamespace:
    """The parts of a `SchedulerOutput` the model reads: one decode, maybe a prefill chunk."""
    return SimpleNamespace(
        decodes=[SimpleNamespace(num_steps=num_steps)],
        prefills=[object()] if prefill else [],
        is_speculative=speculative,
    )


class Engine:
    """Feeds a `DraftLength` as `LLMEngine._observe` does: per step its time, the drafting seconds so far and the
    per-position counts, with a fixed cost per step and per-position acceptance `rates` (prod over positions)."""

    def __init__(self, model: DraftLength, decode: float, verify: float, per_token: float, rates: list[float]):
        self.model, self.decode, self.verify, self.per_token, self.rates = model, decode, verify, per_token, rates
        self.drafted, self.accepted = [0] * K, [0] * K
        self.draft_seconds = 0.0
        self.choices: list[int] = []

    def run(self, steps: int, batch: int = 1) -> list[int]:
        for _ in range(steps):
            k = self.model.choose(batch)
            self.choices.append(k)
            if k == 0:
                self.model.observe(step(False), self.decode, self.draft_seconds, (self.drafted, self.accepted))
                continue
            self.draft_seconds += k * self.per_token
            reach = 1.0
            for j in range(k):  # 100 drafts a step: counts in proportion to the rates
                reach *= self.rates[j]
                self.drafted[j] += 100
                self.accepted[j] += round(100 * reach)
            seconds = k * self.per_token + self.verify
            self.model.observe(step(True), seconds, self.draft_seconds, (self.drafted, self.accepted))
        return self.choices[-steps:]


def test_it_measures_what_it_lacks_first_then_picks_zero_where_drafting_does_not_pay():
    engine = Engine(DraftLength(K), decode=0.010, verify=0.020, per_token=0.008, rates=[0.3] * K)
    # K to measure drafting, then two plain steps (the first one follows a speculative step: not measured), then
    # the choice: 0; the probe (K) once MIN_INTERVAL steps have run.
    assert engine.run(MIN_INTERVAL + 2) == [K] + [0] * (MIN_INTERVAL - 1) + [K, 0]
    model = engine.model
    assert model.expected_tokens(0) == 1.0 and model.expected_tokens(2) == pytest.approx(1 + 0.3 + 0.09, abs=0.01)
    costs = model.buckets[1]
    assert (costs.decode, costs.verify, costs.per_draft_token) == pytest.approx((0.010, 0.020, 0.008))


def test_it_picks_the_longest_draft_where_acceptance_is_high_and_drafts_are_cheap():
    engine = Engine(DraftLength(K), decode=0.010, verify=0.012, per_token=0.001, rates=[0.9] * K)
    # Measured, then K; the probe of 0 after MIN_INTERVAL steps is three plain steps, then K again.
    assert engine.run(2 * MIN_INTERVAL) == [K, 0, 0] + [K] * (MIN_INTERVAL - 3) + [0] * 3 + [K] * (MIN_INTERVAL - 3)
    assert engine.model.best(engine.model.buckets[1]) == K


def test_a_length_in_between_wins_where_acceptance_falls_along_the_draft():
    # E(1) = 1.95 in 0.012 s, E(2) = 1.99 in 0.014 s: one draft token is the best rate.
    engine = Engine(DraftLength(K), decode=0.010, verify=0.010, per_token=0.002, rates=[0.95, 0.05, 0.05, 0.05])
    engine.run(3)
    assert engine.run(5) == [1] * 5


def test_it_probes_on_a_doubling_interval_and_turns_drafting_back_on_when_it_pays():
    engine = Engine(DraftLength(K), decode=0.010, verify=0.020, per_token=0.008, rates=[0.2] * K)
    choices = engine.run(3 * MIN_INTERVAL + 4)
    # Measured; a probe of K after MIN_INTERVAL steps; it confirmed 0, so the next comes after twice as many.
    assert [i for i, k in enumerate(choices) if k] == [0, MIN_INTERVAL, 3 * MIN_INTERVAL + 1]
    assert engine.model.buckets[1].interval == 4 * MIN_INTERVAL
    # The draft gets good and cheap: the next probes see it, and drafting turns back on for good (only probes of
    # 0, three steps each, on a doubling interval).
    engine.per_token, engine.verify, engine.rates = 0.001, 0.011, [0.95] * K
    choices = engine.run(5 * MAX_INTERVAL)
    assert choices.index(K) < 4 * MIN_INTERVAL and choices[2 * MAX_INTERVAL] == K
    assert choices[-3 * MAX_INTERVAL :].count(0) == 3 * 3  # a probe every MAX_INTERVAL steps


def test_buckets_are_measured_apart_and_unmeasured_steps_teach_nothing():
    model = DraftLength(K)
    assert [bucket_of(n) for n in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]
    model.choose(3)
    model.observe(step(True, prefill=True), 5.0, 0.1, ([1], [1]))  # a prefill chunk in it: not measured
    assert model.buckets[4].verify is None and model.drafted[0] == 1
    model.observe(step(False), 5.0, 0.1, ([1], [1]))  # no choice made for it (batch too large): k = 0
    assert (model.chosen_tokens, model.decode_steps) == (K, 2)
    model.choose(1)
    model.observe(step(False, num_steps=4), 0.04, 0.1, ([1], [1]))  # after a step with a prefill: not measured
    model.choose(1)
    model.observe(step(False, num_steps=4), 0.04, 0.1, ([1], [1]))  # a 4-step loop: 10 ms a step
    assert model.buckets[1].decode == pytest.approx(0.01) and model.buckets[4].decode is None


def test_pinned_it_always_drafts_the_most():
    engine = Engine(DraftLength(K, adaptive=False), decode=0.010, verify=0.030, per_token=0.010, rates=[0.1] * K)
    assert engine.run(40) == [K] * 40
    assert engine.model.chosen_tokens == 40 * K and engine.model.decode_steps == 40
