"""Engine behaviour on the tiny random model: batching, preemption, sampling, stops, aborts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.engine_client import PromptTooLongError

SMALL = dict(
    max_num_seqs=64,
    max_num_batched_tokens=128,
    max_model_len=256,
    block_size=8,
    decode_batch_buckets=(1, 4, 16, 64),
    block_table_buckets=(32,),
    prefill_token_buckets=(32, 128),
    prefill_seq_buckets=(1, 4),
)


def make_llm(**overrides) -> LLM:
    return LLM(build_tiny_random(), **{**SMALL, **overrides})


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_blocks=512)


@pytest.fixture(autouse=True)
def pool_is_free_after(request, assert_kv_all_free):
    yield
    if "llm" in request.fixturenames:
        assert_kv_all_free(request.getfixturevalue("llm").engine)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, int(rng.integers(1, 120))).tolist() for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_alone_vs_64_concurrent(llm):
    prompts = mixed_prompts(64)
    together = texts(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    for i in (0, 17, 63):
        alone = texts(llm.generate({"prompt_token_ids": prompts[i]}, GREEDY, use_tqdm=False))[0]
        assert alone == together[i]
    assert all(len(t) == 12 for t in together)


def test_a_prompt_arriving_mid_decode_shares_one_model_step_with_the_decodes(llm, monkeypatch):
    """Prefill chunks and decodes of one iteration run as one mixed model step, and each
    request's tokens are those it gets alone."""
    engine = llm.engine
    prepared = []
    prepare = engine.runner.prepare
    monkeypatch.setattr(engine.runner, "prepare", lambda sched: prepared.append(prepare(sched)) or prepared[-1])
    prompts = mixed_prompts(3, seed=9)
    tokens = {}

    def step():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)

    engine.add_prompt_ids("first", prompts[0], GREEDY)
    step()  # its prefill
    mixed = engine.stats.mixed_steps
    engine.add_prompt_ids("second", prompts[1], GREEDY)
    engine.add_prompt_ids("third", prompts[2], GREEDY)
    step()  # the new prompts' chunks with the first request's decode
    assert engine.stats.mixed_steps == mixed + 1
    assert [p.key[0] for p in prepared[-1].programs] == ["prefill"]
    assert [len(chunks) for chunks in prepared[-1].parts] == [3]
    while engine.has_unfinished_requests():
        step()
    monkeypatch.undo()
    for rid, prompt in zip(("first", "second", "third"), prompts):
        assert tokens[rid] == texts(llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False))[0]


def test_chunked_prefill_and_prefix_cache_do_not_change_outputs(llm):
    prompts = mixed_prompts(8, seed=1)
    base = texts(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    # The same prompts again: now their full blocks are prefix-cache hits.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert texts(again) == base
    assert sum(o.num_cached_tokens for o in again) > 0
    unchunked = make_llm(
        warm_up=False,
        num_blocks=512,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        prefill_token_buckets=(32, 256),
    )
    assert texts(unchunked.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)) == base


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_resume_with_the_same_output(llm, mode, assert_kv_all_free):
    prompts = mixed_prompts(24, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = texts(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    tight = make_llm(warm_up=False, num_blocks=60, preemption_mode=mode, swap_space_blocks=200 if mode == "swap" else 0)
    got = texts(tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_kv_all_free(tight.engine)


def test_seeded_sampling_is_reproducible_and_neighbour_independent(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    prompt = {"prompt_token_ids": mixed_prompts(1, seed=3)[0]}
    alone = texts(llm.generate(prompt, params, use_tqdm=False))[0]
    others = [{"prompt_token_ids": p} for p in mixed_prompts(9, seed=4)]
    neighbour = SamplingParams(max_tokens=16, temperature=0.8)
    mixed = llm.generate(
        others[:4] + [prompt] + others[4:], [neighbour] * 4 + [params] + [neighbour] * 5, use_tqdm=False
    )
    assert texts(mixed)[4] == alone
    assert texts(llm.generate(prompt, params, use_tqdm=False))[0] == alone
    unseeded = texts(llm.generate([prompt, prompt], SamplingParams(max_tokens=16, temperature=1.0), use_tqdm=False))
    assert unseeded[0] != unseeded[1]


def test_decode_sampling_rows_lift_the_stop_token_ban_exactly_at_min_tokens(llm, monkeypatch):
    """Each request's sampling row is written once when it joins the batch; the steps gather it.
    Its stop tokens are banned while fewer than min_tokens are out and not after, the positions
    advance by one a step, and seeded tokens equal those sampled alone."""
    engine = llm.engine
    prepared = []
    prepare = engine.runner.prepare
    monkeypatch.setattr(engine.runner, "prepare", lambda sched: prepared.append(prepare(sched)) or prepared[-1])
    prompts = mixed_prompts(2, seed=6)
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=7, min_tokens=4, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=8, ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    monkeypatch.undo()
    decodes = [p.programs[0].sampling for p in prepared if [q.key[0] for q in p.programs] == ["decode"]]
    assert len(decodes) == 9  # the prefill samples the first token, nine decode steps the rest
    # Decode step i samples token i + 2: the ban holds for tokens 2..4 (min_tokens = 4).
    assert [5 in s.bias_ids[0] for s in decodes] == [i + 2 <= 4 for i in range(9)]
    assert not any(5 in s.bias_ids[1] for s in decodes)
    for s in decodes:
        np.testing.assert_allclose(np.asarray(s.temperature)[:2], [1.0, 0.9])
        assert int(np.asarray(s.top_k)[1]) == 20
    for a, b in zip(decodes, decodes[1:]):
        np.testing.assert_array_equal(b.positions[:2], a.positions[:2] + 1)
    for prompt, p, out in zip(prompts, params, outs):
        assert texts(llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)) == texts([out])


def test_no_compilation_after_warm_up_for_a_mixed_workload(llm):
    before = llm.engine.num_compilations
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(200, seed=5)]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 24)),
            temperature=float(rng.choice([0.0, 0.7])),
            top_k=int(rng.choice([0, 5])),
            logprobs=int(rng.choice([0, 3])),
            seed=i,
        )
        for i in range(200)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 200 and all(o.finished for o in outs)
    assert llm.engine.num_compilations == before


def test_unrolled_layers_give_the_scanned_engines_tokens(llm, assert_kv_all_free):
    """`unroll_layers` (per-layer weights, no scan) is a speed option only: greedy and seeded
    tokens of a mixed batch equal the scanned engine's, and serving compiles nothing new."""
    unrolled = make_llm(num_blocks=512, unroll_layers=True)
    layers = unrolled.engine.runner.params
    assert "layers" not in layers and {"layers_0", "layers_1"} <= set(layers)  # separate per-layer weights
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(12, seed=6)]
    params = [
        GREEDY if i % 2 else SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=i, ignore_eos=True)
        for i in range(12)
    ]
    compiled = unrolled.engine.num_compilations
    assert texts(unrolled.generate(prompts, params, use_tqdm=False)) == texts(
        llm.generate(prompts, params, use_tqdm=False)
    )
    assert unrolled.engine.num_compilations == compiled
    assert_kv_all_free(unrolled.engine)


def test_stop_string_split_across_tokens_never_leaks(llm):
    prompt = {"prompt_token_ids": mixed_prompts(1, seed=6)[0]}
    full = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    tok = llm.get_tokenizer()
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    boundary = len(pieces[10])
    stop = full.text[boundary - 1 : boundary + 2]
    assert len(stop) == 3
    out = llm.generate(
        prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_max_tokens(llm):
    prompt = {"prompt_token_ids": mixed_prompts(1, seed=7)[0]}
    full = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate(
        prompt,
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]


def test_prompt_over_the_context_is_a_clear_error(llm):
    with pytest.raises(PromptTooLongError, match="context"):
        llm.generate({"prompt_token_ids": [5] * 256}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # A prompt that fits but whose max_tokens would overflow stops at the context length.
    out = llm.generate(
        {"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("to-abort", mixed_prompts(1, seed=8)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.usage().used > 0
    final = engine.abort("to-abort")
    assert final and final[-1].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_n_greater_than_one_shares_the_prompt_blocks(llm):
    prompt = mixed_prompts(1, seed=9)[0] + list(range(3, 60))
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # different streams per choice
    # Two of the three choices found the prompt's full blocks computed by the first.
    assert out.num_cached_tokens >= (len(prompt) // 8) * 8 - 8


def test_generate_jsonl_with_bad_lines(llm, tmp_path):
    from jaxserve.generate_jsonl import run

    src = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": "hello", "max_tokens": 4}),
        "{not json",
        json.dumps({"id": "c", "prompt": "x", "temperature": -1}),
        json.dumps({"id": "d", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        json.dumps({"id": "e", "prompt": [7] * 400}),
        json.dumps({"id": "f", "prompt": "bye", "bogus": 1}),
    ]
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    counts = run(llm, src, dst, {"max_tokens": 5, "temperature": 0.0})
    assert counts == {"generated": 2, "errors": 4, "skipped": 0}
    recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(recs) == {"a", "2", "c", "d", "e", "f"}
    assert len(recs["a"]["outputs"][0]["token_ids"]) == 4
    assert "error" in recs["2"] and "error" in recs["c"] and "context" in recs["e"]["error"]
    # Resumable: a second run skips what is done.
    assert run(llm, src, dst, {"max_tokens": 5})["skipped"] == 6


def test_generate_as_completed_yields_each_request_when_it_finishes(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 2, 6)]
    finished = list(llm.generate_as_completed([[5, 6, 7], [8, 9], [10, 11, 12]], params, use_tqdm=False))
    assert [index for index, _ in finished] == [1, 2, 0]  # shortest first
    assert [len(out.outputs[0].token_ids) for _, out in finished] == [2, 6, 12]
    # Closing the iterator early aborts what is still running (the pool check runs after the test).
    running = llm.generate_as_completed([[5, 6, 7], [8, 9]], params[:2], use_tqdm=False)
    assert next(running)[0] == 1
    running.close()
    assert not llm.engine.has_unfinished_requests()


def test_generate_jsonl_keeps_what_finished_when_interrupted(llm, tmp_path):
    from jaxserve.generate_jsonl import run

    class InterruptedAfterThree:
        """The LLM, as if Ctrl-C arrived after three requests finished."""

        engine = llm.engine
        get_tokenizer = llm.get_tokenizer

        @staticmethod
        def generate_as_completed(*args, **kwargs):
            finished = llm.generate_as_completed(*args, **kwargs)
            for _ in range(3):
                yield next(finished)
            finished.close()
            raise KeyboardInterrupt

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lengths = {"a": 3, "b": 30, "c": 2, "d": 1}  # d, c and a finish before b
    src.write_text(
        "".join(
            json.dumps({"id": k, "prompt": [5, 6], "max_tokens": n, "ignore_eos": True}) + "\n"
            for k, n in lengths.items()
        )
    )
    with pytest.raises(KeyboardInterrupt):
        run(InterruptedAfterThree(), src, dst, {"temperature": 0.0})
    assert [json.loads(line)["id"] for line in dst.read_text().splitlines()] == ["a"]  # b holds c and d back
    assert run(llm, src, dst, {"temperature": 0.0}) == {"generated": 3, "errors": 0, "skipped": 1}
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c", "d"]
    assert [r["usage"]["completion_tokens"] for r in records] == list(lengths.values())


def test_the_context_is_the_models_own_unless_the_kv_cache_cannot_hold_it(caplog):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    model = build_tiny_random()  # a context of 2,048 tokens
    small = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
    engine = LLMEngine(model, EngineConfig(num_blocks=300, **small))
    assert engine.config.max_model_len == 2048
    assert engine.config.block_table_buckets == (256,)  # the buckets follow the context
    assert engine.encode_prompt([5] * 2047) == [5] * 2047
    # A longer setting than the model's context is lowered to it.
    assert LLMEngine(model, EngineConfig(num_blocks=300, max_model_len=4096, **small)).config.max_model_len == 2048
    # A KV cache too small for one request of the whole context: lowered to what it holds, and said.
    with caplog.at_level("WARNING"):
        short = LLMEngine(model, EngineConfig(num_blocks=101, **small))  # 100 usable blocks, 1 kept as watermark
    assert short.config.max_model_len == 99 * 8
    assert "lowering max_model_len to 792 tokens" in caplog.text
    with pytest.raises(PromptTooLongError):
        short.encode_prompt([5] * 792)
