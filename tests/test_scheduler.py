"""Scheduler policies on the real KV manager, with the model replaced by 'sample token 7'."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest
from config_harness import resolved

from jaxserve.image_prompt import PromptImage
from jaxserve.images import ImageInput
from jaxserve.kv import build_kv_manager
from jaxserve.outputs import FinishReason
from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler


def make(num_blocks=64, encoded=frozenset(), **cfg):
    base = dict(
        block_size=4,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_prefill_seqs=4,
        block_table_buckets=(64,),
    )
    config = resolved(**{**base, **cfg})
    kv = build_kv_manager(
        num_blocks,
        config.block_size,
        watermark_blocks=0,
        enable_prefix_cache=config.enable_prefix_caching,
        num_host_slots=config.swap_space_blocks,
    )
    return Scheduler(config, kv, encoded_images=encoded)


def req(rid, n_prompt, max_tokens=4, priority=0, prompt=None):
    # crc32, not hash(): str hashes change per process, and two ids colliding mod 50 would share
    # a cached prefix in some runs only.
    ids = prompt if prompt is not None else [(zlib.crc32(rid.encode()) + i) % 50 + 3 for i in range(n_prompt)]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, priority=priority), seed=0)


def step(s: Scheduler):
    """One engine step without a model: every sampling chunk 'samples' token 7."""
    out = s.schedule()
    s.on_step_launched(out)
    for c in out.prefills + out.decodes:
        if c.sample:
            c.request.output_token_ids[c.output_index] = 7
            if len(c.request.output_token_ids) >= c.request.params.max_tokens:
                s.finish(c.request, FinishReason.LENGTH)
    s.kv.check_integrity()
    return out


def test_no_jax_import():
    import jaxserve.scheduler.encoder_budget as encoder_budget
    import jaxserve.scheduler.output as output
    import jaxserve.scheduler.scheduler as scheduler

    for mod in (scheduler, output, encoder_budget):
        assert "import jax" not in open(mod.__file__).read()


def test_long_prompt_is_chunked_and_decodes_keep_flowing():
    s = make()
    short = req("short", 5, max_tokens=10)
    s.add_request(short)
    step(s)  # short's prompt
    long = req("long", 100)
    s.add_request(long)
    chunks = []
    while long.num_computed_tokens < 100:
        out = step(s)
        assert short in [c.request for c in out.decodes], "the running decode was starved"
        assert out.num_tokens <= 32
        chunks += [c.num_new_tokens for c in out.prefills if c.request is long]
    assert sum(chunks) == 100 and len(chunks) > 3


def test_partial_prefill_cap_lets_short_prompts_pass():
    s = make(max_num_partial_prefills=1)
    a, b, c = req("a", 90), req("b", 90), req("c", 6)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    scheduled = {ch.request.request_id for ch in out.prefills}
    assert "a" in scheduled and "b" not in scheduled  # one long prompt chunked at a time
    assert "c" in scheduled  # the short one behind them is not blocked


def test_long_prompts_with_no_short_one_waiting_fill_the_whole_budget():
    """The half-budget cap is for short prompts behind a long one; with only long prompts
    waiting (which the partial-prefill limit keeps out) it would leave half of every step idle."""
    s = make(max_num_partial_prefills=1)
    a, b = req("a", 40), req("b", 40)
    for r in (a, b):
        s.add_request(r)
    out = step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.prefills] == [("a", 32)]
    out = step(s)  # a's last 8 tokens, and b starts in the rest of the step
    assert [(c.request.request_id, c.num_new_tokens) for c in out.prefills] == [("a", 8), ("b", 24)]


def test_two_partial_prefills_share_the_budget():
    s = make(max_num_partial_prefills=2)
    a, b = req("a", 90), req("b", 90)
    for r in (a, b):
        s.add_request(r)
    out = step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.prefills] == [("a", 16), ("b", 16)]


def test_shared_prefix_computed_once_within_a_step():
    s = make()
    prefix = list(range(3, 23))  # 5 full blocks
    a, b = req("a", 0, prompt=prefix + [40, 41]), req("b", 0, prompt=prefix + [42, 43])
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [c.request for c in out.prefills] == [a]  # b waits for a's blocks...
    out = step(s)
    assert b.num_cached_prompt_tokens == 20  # ...and then finds them in the cache
    assert [c.num_new_tokens for c in out.prefills if c.request is b] == [2]


def test_priority_policy_orders_admission_and_preempts_least_important():
    s = make(num_blocks=17, scheduling_policy="priority", max_num_batched_tokens=64)
    low, high = req("low", 12, max_tokens=30, priority=5), req("high", 12, max_tokens=30, priority=0)
    s.add_request(low)
    s.add_request(high)
    out = step(s)
    assert [c.request for c in out.prefills][0] is high
    for _ in range(30):
        if s.num_preemptions:
            break
        step(s)
    assert s.num_preemptions > 0
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    while s.num_unfinished:
        step(s)
    assert high.is_finished and low.is_finished and len(low.output_token_ids) == 30


def test_swap_preemption_round_trip():
    s = make(num_blocks=9, preemption_mode="swap", swap_space_blocks=32, max_num_batched_tokens=64)
    a, b = req("a", 12, max_tokens=20), req("b", 12, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    saw_swap = False
    while s.num_unfinished:
        step(s)
        saw_swap |= b.status is RequestStatus.SWAPPED
    assert saw_swap
    assert len(a.output_token_ids) == 20 and len(b.output_token_ids) == 20
    assert s.kv.usage().used == 0 and s.kv.usage().host_swapped == 0


def test_lpm_prefers_cached_prefix_with_starvation_guard(monkeypatch):
    s = make(scheduling_policy="lpm", max_prefill_seqs=1)
    shared = list(range(3, 23))
    warm = req("warm", 0, prompt=shared + [1, 2])
    s.add_request(warm)
    while s.num_unfinished:
        step(s)
    cold, hit = req("cold", 0, prompt=list(range(30, 52))), req("hit", 0, prompt=shared + [9, 9])
    s.add_request(cold)
    s.add_request(hit)
    out = s.schedule()
    assert [c.request for c in out.prefills] == [hit]
    s.on_step_launched(out)
    # A request that waited past the guard goes first whatever its match.
    late = req("late", 0, prompt=list(range(60, 80)))
    late.arrival_time = time.monotonic() - 60
    s.add_request(late)
    s.add_request(req("hit2", 0, prompt=shared + [8, 8]))
    out = s.schedule()
    assert out.prefills[0].request.request_id == "late"


def test_a_requests_tokens_are_copied_by_range_and_salted_for_the_cache_only_in_the_copy():
    from jaxserve.kv.content_keys import salt_token
    from jaxserve.lora.manager import AdapterRef

    r = req("t", 0, prompt=[10, 11, 12])
    r.output_token_ids += [20, 21]
    assert r.copy_tokens() == [10, 11, 12, 20, 21]
    assert (r.copy_tokens(1, 2), r.copy_tokens(2, 4), r.copy_tokens(3), r.copy_tokens(0, 0)) == (
        [11],
        [12, 20],
        [20, 21],
        [],
    )
    r.copy_tokens().append(99)  # a new list: the request's sequence is untouched
    assert r.num_tokens == 5 and r.copy_tokens(4) == [21]
    r.adapter = AdapterRef("sql", 3, None)
    assert r.copy_cache_tokens(2) == [salt_token(3, 10), 11] and r.prompt_token_ids[0] == 10


def test_the_decode_loop_says_how_many_steps_each_decode_runs_and_the_scheduler_reserves_their_kv_slots():
    from jaxserve.scheduler.multi_step import MultiStepDecode, SingleStep

    assert isinstance(make().decode_loop, SingleStep)
    s = make(num_scheduler_steps=4)
    assert isinstance(s.decode_loop, MultiStepDecode)
    a, b = req("a", 5, max_tokens=10), req("b", 5, max_tokens=3)
    for r in (a, b):
        s.add_request(r)
    step(s)  # both prompts, each samples its first token
    before = {r.request_id: r.kv.num_tokens for r in (a, b)}
    out = s.schedule()
    # b may sample 2 more tokens (max_tokens 3): its loop stops there.
    assert {c.request.request_id: c.num_steps for c in out.decodes} == {"a": 4, "b": 2}
    assert out.samples_several and all(c.samples_several for c in out.decodes)
    assert {r.request_id: r.kv.num_tokens - before[r.request_id] for r in (a, b)} == {"a": 4, "b": 2}
    # A prompt waiting to start: the loop would hold it back, so every decode takes one step.
    assert s.decode_loop.steps_of([a, b], lambda: False)(a) == 1


def digest(name: str) -> bytes:
    return name.encode().ljust(16, b"-")  # digests are 16 bytes (the prefix cache's salt reads them)


def image_req(rid, n_prompt, images):
    """A prompt with 4-token images at the positions `images` maps to their names."""
    spans = tuple(PromptImage(at, 4, ImageInput(np.zeros(1, np.float32), digest(n))) for at, n in images.items())
    r = req(rid, n_prompt, max_tokens=1)
    r.images = spans
    return r


def encoded_by_step(s: Scheduler, cache: set, max_steps: int = 20) -> list[set]:
    """Run until every request is done; per step, the names of the images not in `cache` that its chunks
    hold (which the runner would encode, then keep in `cache`)."""
    steps = []
    while s.num_unfinished and len(steps) < max_steps:
        out = step(s)
        new = {
            i.image.digest
            for c in out.prefills
            for i in c.request.images
            if i.start < c.start + c.num_new_tokens and c.start < i.end and i.image.digest not in cache
        }
        cache |= new
        steps.append({d.rstrip(b"-").decode() for d in new})
    assert not s.num_unfinished
    return steps


def test_encoder_budget_defers_images_past_it_to_later_steps():
    prompts = {"a": {4: "a1", 12: "a2", 20: "a3"}, "b": {0: "b1"}}
    for limit, want in ((None, [{"a1", "a2", "a3", "b1"}]), (2, [{"a1", "a2"}, {"a3", "b1"}])):
        cache: set = set()
        s = make(encoded=cache, max_num_encoder_images=limit, max_num_partial_prefills=2)
        for rid, images in prompts.items():
            s.add_request(image_req(rid, 28, images))
        steps = [new for new in encoded_by_step(s, cache) if new]
        assert steps == want, limit


def test_a_step_encodes_one_image_at_least_so_every_prompt_goes_on():
    cache: set = set()
    s = make(encoded=cache, max_num_encoder_images=1)
    s.add_request(image_req("a", 24, {0: "a1", 4: "a2", 8: "a3"}))  # images back to back from its start
    chunks = []
    for new in encoded_by_step(s, cache):
        assert len(new) <= 1
        chunks.append(new)
    assert [c for c in chunks if c] == [{"a1"}, {"a2"}, {"a3"}]


def test_cached_and_repeated_images_cost_nothing():
    cache = {digest("seen")}
    s = make(encoded=cache, max_num_encoder_images=1)
    s.add_request(image_req("a", 28, {4: "seen", 12: "new", 20: "new"}))
    out = step(s)
    assert [c.num_new_tokens for c in out.prefills] == [28]  # one image to encode: all in one step


def test_without_chunked_prefill_a_prompt_over_the_budget_runs_alone():
    cache: set = set()
    s = make(
        encoded=cache,
        max_num_encoder_images=1,
        enable_chunked_prefill=False,
        max_num_batched_tokens=256,
        prefill_token_buckets=(256,),
    )
    s.add_request(image_req("many", 20, {0: "m1", 8: "m2"}))
    s.add_request(image_req("one", 20, {0: "o1"}))
    s.add_request(req("text", 20, max_tokens=1))
    out = step(s)
    assert {c.request.request_id: c.num_new_tokens for c in out.prefills} == {"many": 20, "text": 20}
    assert [c.request.request_id for c in step(s).prefills] == ["one"]


def test_encoder_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_num_encoder_images must be an integer >= 1"):
        make(max_num_encoder_images=0)
