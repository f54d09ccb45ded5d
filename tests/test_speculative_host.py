"""Host side of speculative decoding (no JAX): the n-gram lookup, the config, the `Proposer` interface
(`NgramProposer` and its pause), the scheduler's drafts with their KV slots (allocated for every
draft, released for the rejected), and the hidden states an MTP proposer keeps (`PendingHidden`)."""

from __future__ import annotations

import numpy as np
import pytest
from config_harness import resolved

from jaxserve.config import EngineConfig
from jaxserve.kv import build_kv_manager
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.speculative import NgramProposer, SpeculativeConfig, build_proposer, propose_ngram
from jaxserve.speculative.hidden_rows import PendingHidden


def test_the_longest_recurring_ngram_proposes_what_followed_its_latest_occurrence():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" recurs once (at 0): the 3-gram wins over the later "2 3" at 6.
    assert propose_ngram(tokens, 2, 1, 3) == [4, 5]
    # Limited to 2-grams, the latest "2 3" (at 6) is followed by 7, 8.
    assert propose_ngram(tokens, 3, 1, 2) == [7, 8, 1]
    assert propose_ngram([5, 6, 5, 6, 5], 4, 1, 2) == [6, 5]  # the draft stops at the sequence's end
    assert propose_ngram([4, 4, 4], 2, 1, 1) == [4]


def test_no_draft_without_a_recurring_ngram_of_at_least_min_n():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 9, 1, 2, 8, 2], 3, 2, 3) == []  # only "2" recurs
    assert propose_ngram([7], 3, 1, 3) == []
    assert propose_ngram([1, 1], 0, 1, 1) == []


def test_pending_hidden_states_by_position_zeros_where_none_came_and_recomputed_ones_replace():
    def rows(first: int, n: int) -> np.ndarray:
        return np.arange(first, first + n, dtype=np.float32)[:, None].repeat(2, axis=1)

    pending = PendingHidden(2)
    pending.add(4, rows(4, 6))  # positions 4 .. 9 (0 .. 3: a prefix-cache hit, never computed)
    pending.add(10, rows(10, 2))
    assert pending.take(2, 5)[:, 0].tolist() == [0, 0, 4, 5, 6]
    pending.add(8, rows(108, 3))  # 8 .. 10 again (a verify step's rows after a preemption, say): they replace
    assert pending.take(7, 5)[:, 0].tolist() == [7, 108, 109, 110, 0]
    pending.drop_before(9)
    assert pending.num_rows == 2 and pending.take(8, 3)[:, 0].tolist() == [0, 109, 110]
    pending.drop_before(20)
    assert pending.num_rows == 0 and not pending.segments


def test_config_takes_vllms_names_from_json_or_a_dict():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert spec == SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 5, 5)
    # A draft model: vLLM's names, and a model without a method means one.
    drafted = SpeculativeConfig("draft_model", 4, model="qwen2.5-coder-0.5b-instruct")
    assert SpeculativeConfig.parse('{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}') == drafted
    assert SpeculativeConfig.parse({"method": "draft_model", "model": drafted.model, "num_speculative_tokens": 4}) == (
        drafted
    )
    quantized = SpeculativeConfig.parse({"model": drafted.model, "num_speculative_tokens": 4, "quantization": "q4"})
    assert quantized.quantization == "q4"  # the draft's own --quantization (vLLM's name)
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(spec) is spec
    assert EngineConfig(speculative_config=spec).speculative_config is spec


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown speculative method 'eagle'; use one of ngram"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', '"eagle3" needs "model": the head\'s directory'),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', '"draft_model" needs "model"'),
        ('{"method": "draft_model", "model": " ", "num_speculative_tokens": 2}', '"draft_model" needs "model"'),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "'ngram' takes no model, got model='x'"),
        ('{"num_speculative_tokens": 2, "quantization": "q4"}', "takes no model, got model=None, quantization='q4'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1, got 0"),
        ('{"num_speculative_tokens": true}', "num_speculative_tokens must be an integer >= 1, got True"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "must not exceed"),
        ('{"num_speculative_tokens": 2, "lookahead": 1}', r"unknown speculative_config fields: \['lookahead'\]"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ("[1]", "must be a JSON object, got list"),
        ("{", "not valid JSON"),
    ],
)
def test_a_bad_speculative_config_is_refused_with_what_is_wrong(text, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.from_json(text)


def test_the_engine_config_holds_one_speculative_type():
    """Text and dicts are read at the edges (flags, `LLM(...)`); the engine config takes only the parsed type."""
    with pytest.raises(ValueError, match="speculative_config must be a SpeculativeConfig or None"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2})


def test_the_speculative_config_flag_parses_json_and_names_what_is_wrong(capsys):
    import argparse

    from jaxserve.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig("ngram", 4)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 1}'])
    assert '--speculative-config: speculative method "eagle3" needs "model"' in capsys.readouterr().err


def make_scheduler(k: int = 3, disable_by_batch_size: int = 8, num_blocks: int = 64):
    config = resolved(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        num_blocks=num_blocks,
        speculative_config=SpeculativeConfig(
            "ngram",
            k,
            prompt_lookup_min=1,
            prompt_lookup_max=2,
            disable_by_batch_size=disable_by_batch_size,
            adaptive_draft_length=False,
        ),
    )
    kv = build_kv_manager(num_blocks, 4)
    return Scheduler(config, kv, proposer=build_proposer(config.speculative_config, config.max_model_len)), kv


def may_draft(sched: Scheduler) -> bool:
    """What the engine asks before scheduling (it reads the step in flight first while drafts may come)."""
    return sched.proposer.may_propose(len(sched.running))


def decoding(sched: Scheduler, rid: str, prompt: list[int], first: int, max_tokens: int = 20) -> Request:
    """A request through its prefill, with its first token read."""
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), seed=0)
    sched.add_request(req)
    out = sched.schedule()
    assert [c.request for c in out.prefills] == [req]
    sched.on_step_launched(out)
    req.output_token_ids[-1] = first
    return req


def test_drafts_get_slots_and_the_rejected_ones_are_released():
    sched, kv = make_scheduler(k=3)
    req = decoding(sched, "a", [1, 2, 3, 4, 5, 6, 1, 2], 3)  # "2 3" recurs: draft 4 5 6
    out = sched.schedule()
    (chunk,) = out.decodes
    assert chunk.draft == [4, 5, 6] and out.num_tokens == 4
    assert req.kv.num_tokens == 9 + 3  # the last token's slot and one per draft
    assert len(chunk.block_table) == 3  # 12 slots of 4
    sched.on_step_launched(out)
    req.output_token_ids[-1] = 4  # the verify step accepted one draft, then sampled 9
    req.output_token_ids.append(9)
    sched.accept_tokens(req, 1)
    assert req.num_computed_tokens == req.kv.num_tokens == 10  # positions 0..9 hold valid K/V
    assert len(req.kv.block_table) == 3
    kv.check_integrity()


def test_a_rejected_draft_that_crossed_a_block_frees_that_block():
    sched, kv = make_scheduler(k=3)
    req = decoding(sched, "a", [5, 6, 7, 5, 6, 7, 5], 6)  # 8 tokens: two full blocks of 4
    free_before = kv.num_available_blocks
    out = sched.schedule()
    assert out.decodes[0].draft == [7, 5, 6]
    assert kv.num_available_blocks == free_before - 1  # positions 8..10 need a third block
    sched.on_step_launched(out)
    req.output_token_ids[-1] = 2  # the first draft rejected: 2 instead of 7
    sched.accept_tokens(req, 0)
    assert req.kv.num_tokens == 8 and kv.num_available_blocks == free_before
    kv.check_integrity()


def test_no_drafts_above_the_batch_threshold_for_a_token_in_flight_or_past_max_tokens():
    sched, kv = make_scheduler(k=3, disable_by_batch_size=1)
    a = Request("a", [1, 2, 1, 2], SamplingParams(max_tokens=20), seed=0)
    b = Request("b", [3, 4, 3, 4], SamplingParams(max_tokens=5), seed=0)
    for req in (a, b):
        sched.add_request(req)
    out = sched.schedule()
    sched.on_step_launched(out)
    a.output_token_ids[-1], b.output_token_ids[-1] = 1, 3
    assert not may_draft(sched)
    out = sched.schedule()
    assert len(out.decodes) == 2 and not out.is_speculative  # two decodes > threshold 1
    sched.on_step_launched(out)
    sched.finish(a, "stop")
    assert may_draft(sched)
    out = sched.schedule()  # b's last token is still in flight: nothing to look up
    assert out.decodes[0].request is b and out.decodes[0].draft == []
    sched.on_step_launched(out)
    b.output_token_ids[-2:] = [4, 3]
    out = sched.schedule()  # 3 of 5 generated: one draft at most, "4 3" was followed by 4
    assert out.decodes[0].draft == [4]
    sched.finish(b, "stop")
    kv.check_integrity()
    assert kv.usage().used == 0


def test_draftless_steps_pause_speculation_for_doubling_stretches_and_a_draft_ends_the_pause():
    """While paused, `may_propose` is False: the engine keeps async scheduling's overlap."""
    sched, kv = make_scheduler(k=2)
    req = decoding(sched, "a", [10, 11, 12, 13], 14, max_tokens=60)
    seen = []
    for token in range(15, 27):  # tokens that never recur: no draft anywhere
        seen.append(may_draft(sched))
        out = sched.schedule()
        assert not out.is_speculative
        sched.on_step_launched(out)
        req.output_token_ids[-1] = token
    T, F = True, False
    assert seen == [T, F, T, F, F, T, F, F, F, F, T, F]  # pauses of 1, 2, 4, then 8
    for token in range(27, 40):
        if may_draft(sched):
            break
        sched.on_step_launched(sched.schedule())
        req.output_token_ids[-1] = token
    assert token == 34  # the 8-step pause had 7 steps left
    req.output_token_ids[-1] = 11  # "11" recurs in the prompt, followed by 12 13
    out = sched.schedule()
    assert out.decodes[0].draft == [12, 13]
    sched.on_step_launched(out)
    req.output_token_ids[-1] = 5  # both drafts rejected
    sched.accept_tokens(req, 0)
    assert may_draft(sched)  # a step with a draft ended the backoff
    sched.on_step_launched(sched.schedule())
    req.output_token_ids[-1] = 6
    assert not may_draft(sched)  # the next draftless step pauses for 1 again, not 16
    sched.finish(req, "stop")
    kv.check_integrity()


def test_the_host_side_imports_no_jax():
    import jaxserve.speculative
    import jaxserve.speculative.config
    import jaxserve.speculative.ngram

    for mod in (jaxserve.speculative, jaxserve.speculative.config, jaxserve.speculative.ngram):
        assert "import jax" not in open(mod.__file__).read()


class FixedProposer:
    """A proposer of another kind (as a draft model would be): the same draft for every decode it is given."""

    def __init__(self, draft: list[int]):
        self.draft = draft
        self.scheduled: list[tuple[bool, bool]] = []

    def may_propose(self, num_running: int) -> bool:
        return True

    def propose(self, decodes, num_running):
        return {req: list(self.draft) for req in decodes}

    def on_scheduled(self, looked_up: bool, drafted: bool) -> None:
        self.scheduled.append((looked_up, drafted))

    def draft_probs(self, request) -> None:
        return None

    def release(self, request) -> None:
        pass


def test_the_scheduler_reserves_slots_for_any_proposers_drafts_and_tells_it_what_it_scheduled():
    sched, kv = make_scheduler()
    sched.proposer = proposer = FixedProposer([7, 7])
    req = decoding(sched, "a", [1, 2, 3], 4)  # no n-gram recurs: only this proposer drafts
    out = sched.schedule()
    assert out.decodes[0].draft == [7, 7] and out.num_tokens == 3 and req.kv.num_tokens == 4 + 2
    assert proposer.scheduled[-1] == (True, True)
    sched.on_step_launched(out)
    req.output_token_ids[-1] = 8  # the first draft rejected
    sched.accept_tokens(req, 0)
    assert req.kv.num_tokens == 4
    sched.finish(req, "stop")
    kv.check_integrity()
    assert kv.usage().used == 0


def test_the_proposer_is_built_from_the_speculative_config():
    assert build_proposer(None, 64) is None
    proposer = build_proposer(SpeculativeConfig("ngram", 2), 64)
    assert isinstance(proposer, NgramProposer) and proposer.may_propose(1)
