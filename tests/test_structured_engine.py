"""Structured output in the engine, on the tiny random model: every choice (n > 1, seeded or
greedy) matches its constraint, each with its own grammar state; a grammar that allows nothing
more ends the request with "stop"; async scheduling gives the synchronous loop's tokens; a
constraint the library rejects is a ValueError before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.structured import GuidedDecoding

SMALL = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    num_blocks=256,
    decode_batch_buckets=(16,),
    block_table_buckets=(32,),
    sampler_row_buckets=(16,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
)
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["kind", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    return LLM(build_tiny_random(), async_scheduling=request.param, **SMALL)


@pytest.fixture(autouse=True)
def pool_is_free_after(request, assert_kv_all_free):
    yield
    if "llm" in request.fixturenames:
        assert_kv_all_free(request.getfixturevalue("llm").engine)


def outputs(llm: LLM, prompts: list[str], params: SamplingParams):
    return [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def test_json_schema_with_n_choices_each_valid_and_stopped_by_the_grammar(llm):
    params = SamplingParams(n=3, max_tokens=120, temperature=1.0, seed=7, guided=GuidedDecoding("json", SCHEMA))
    choices = outputs(llm, ["a", "the"], params)
    assert len(choices) == 6
    for c in choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.finish_reason == "stop"
    assert len({c.text for c in choices}) > 1  # each choice has its own grammar state and draw


def test_regex_and_choice_with_greedy_and_seeded_rows_in_one_batch(llm):
    regex = SamplingParams(
        n=2, max_tokens=40, temperature=0.8, seed=1, guided=GuidedDecoding("regex", r"[0-9]{3}-[a-c]{2,4}")
    )
    choice = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecoding("choice", ["yes", "no", "maybe"]))
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["x", "y", "z"], [regex, choice, plain], use_tqdm=False)
    for c in outs[0].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2,4}", c.text), c.text
    assert outs[1].outputs[0].text in ("yes", "no", "maybe") and outs[1].outputs[0].finish_reason == "stop"
    assert len(outs[2].outputs[0].token_ids) == 10  # an unconstrained neighbour runs as before


def test_seeded_constrained_output_repeats_and_max_tokens_still_applies(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, guided=GuidedDecoding("regex", "[a-z]+"))
    first, again = (outputs(llm, ["hello"], params)[0] for _ in range(2))
    assert first.token_ids == again.token_ids
    assert len(first.token_ids) == 6 and first.finish_reason == "length" and re.fullmatch("[a-z]+", first.text)


def test_stop_string_ends_a_constrained_request(llm):
    params = SamplingParams(max_tokens=60, temperature=0.0, stop=["b"], guided=GuidedDecoding("regex", "a{3}b{2}c{3}"))
    out = outputs(llm, ["q"], params)[0]
    assert out.text == "aaa" and out.finish_reason == "stop"


def test_async_gives_the_sync_tokens_in_as_many_steps():
    params = SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=11, guided=GuidedDecoding("json", SCHEMA))
    free = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)  # an unconstrained neighbour
    runs = []
    for async_scheduling in (True, False):
        llm = LLM(build_tiny_random(), warm_up=False, async_scheduling=async_scheduling, **SMALL)
        outs = llm.generate(["p", "q", "r"], [params, params, free], use_tqdm=False)
        stats = llm.engine.stats
        runs.append(([c.token_ids for o in outs for c in o.outputs], stats.num_steps, stats.overlapped_reads))
    assert runs[0][0] == runs[1][0]
    # A constrained request's next mask waits for its token in flight, but it still joins every
    # iteration (none runs its unconstrained neighbour alone): as many steps as the synchronous loop.
    assert runs[0][1] == runs[1][1]
    # And the iterations stay overlapped: each one's model step is dispatched before the one in
    # flight is read (only the first, and the last after the prompts' end, are read alone).
    assert runs[0][2] >= runs[0][1] - 2 and runs[1][2] == 0


@pytest.mark.parametrize(
    "kind,value,message",
    [
        ("json", {"type": "objectx"}, "Invalid type"),
        ("json", [1, 2], "must be an object"),
        ("regex", "a(b", "unclosed group"),
        ("choice", [], "non-empty list"),
        ("grammar", "root ::= (((", "grammar"),
        ("yaml", "x", "kind"),
    ],
)
def test_constraints_the_library_rejects_raise_value_error(kind, value, message):
    with pytest.raises(ValueError, match=message):
        GuidedDecoding(kind, value)


def test_a_constrained_rows_mask_is_written_after_its_step_is_built(llm):
    """`prepare` leaves the mask row allowing everything and lists it; the runner writes it with
    `write_token_masks` once the model step is on the device (the mask overlaps the step)."""
    from jaxserve.runner.prepared_step import write_token_masks

    engine = llm.engine
    (req,) = engine.add_request(
        "mask-timing", "Hi", SamplingParams(max_tokens=4, guided=GuidedDecoding("json", SCHEMA))
    )
    try:
        (program,) = engine.runner.prepare(engine.scheduler.schedule()).programs
        assert program.masks == ((0, req.grammar),)
        assert (program.sampling.token_mask[0] == -1).all()  # not computed yet
        written = write_token_masks(program)
        assert written.masks == ()
        allowed = np.unpackbits(program.sampling.token_mask[0].view(np.uint8), bitorder="little")
        assert 0 < allowed.sum() < engine.model_config.vocab_size  # a JSON object's start only
        assert (program.sampling.token_mask[1:] == -1).all()  # padding rows allow everything
    finally:
        engine.abort("mask-timing")
