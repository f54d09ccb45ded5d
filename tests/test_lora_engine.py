"""Multi-LoRA serving in the engine, on the tiny random Llama: every adapter's greedy tokens equal
transformers + PEFT's (tests/data/lora_reference.json, made by tests/data/make_lora_reference.py
from the same adapter bytes, tests/data/lora_adapters.py), alone and in one mixed batch with the
base model; more adapters than LoRA slots take turns (requests wait, none fails); the prefix
cache keeps adapters' KV apart; adapters come and go under load; no compilation after warm-up;
the KV pool and the LoRA slots are all free after each test.
"""

from __future__ import annotations

import json

import pytest
from lora_harness import EXTRA, LORA_ENGINE, TINY_ADAPTERS, reference_runs, write_tiny_adapters

from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.engine_client import UnknownAdapterError


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_tiny_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm(adapters) -> LLM:
    llm = LLM(build_tiny_random(), **LORA_ENGINE)
    for spec in TINY_ADAPTERS:
        llm.engine.add_lora(spec.name, str(adapters[spec.name]))
    return llm


def greedy(name: str | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=name)


def check_all_free(llm: LLM, assert_kv_all_free) -> None:
    assert_kv_all_free(llm.engine)
    assert llm.engine.lora.num_pinned == 0


def test_each_adapter_matches_peft_alone_and_in_one_mixed_batch(llm, assert_kv_all_free):
    assert llm.engine.config.async_scheduling
    compiled = llm.engine.num_compilations
    cases = reference_runs()
    for name, prompt, new_ids in cases:
        out = llm.generate([{"prompt_token_ids": prompt}], greedy(name, len(new_ids)), use_tqdm=False)
        assert out[0].outputs[0].token_ids == new_ids, name
    # All of them at once: 4 adapters and the base model in the same steps.
    outs = llm.generate(
        [{"prompt_token_ids": p} for _, p, _ in cases], [greedy(n, len(t)) for n, _, t in cases], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [t for _, _, t in cases]
    assert len({tuple(t) for _, _, t in cases}) == len(cases)  # every adapter changes the output
    assert llm.engine.num_compilations == compiled
    check_all_free(llm, assert_kv_all_free)


def test_more_adapters_than_lora_slots_wait_their_turn(llm, adapters, assert_kv_all_free):
    """Five adapters on four LoRA slots, all at once: the fifth waits for a LoRA slot no running request pins."""
    engine = llm.engine
    engine.add_lora(EXTRA.name, str(adapters[EXTRA.name]))
    try:
        compiled, loads = engine.num_compilations, engine.lora.stats.device_loads
        alone = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], greedy(EXTRA.name, 8), use_tqdm=False)
        cases = reference_runs()
        names = [EXTRA.name] + [n for n, _, _ in cases]
        prompts = [[5, 6, 7, 8]] + [p for _, p, _ in cases]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n, 8) for n in names], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
        assert [o.outputs[0].token_ids for o in outs[1:]] == [t[:8] for _, _, t in cases]
        assert engine.lora.stats.device_loads > loads + 1  # LoRA slots were reused
        assert engine.lora.num_resident == 4
        assert engine.num_compilations == compiled
    finally:
        engine.remove_lora(EXTRA.name)
    check_all_free(llm, assert_kv_all_free)


def test_the_prefix_cache_keeps_adapters_apart(llm, assert_kv_all_free):
    prompt = {"prompt_token_ids": list(range(10, 43))}  # 4 full blocks of 8
    base = llm.generate([prompt], greedy(None, 4), use_tqdm=False)[0]
    first = llm.generate([prompt], greedy("attn-r8", 4), use_tqdm=False)[0]
    again = llm.generate([prompt], greedy("attn-r8", 4), use_tqdm=False)[0]
    other = llm.generate([prompt], greedy("mlp-r4", 4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0  # not the base's KV, nor each other's
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert base.outputs[0].token_ids != first.outputs[0].token_ids
    check_all_free(llm, assert_kv_all_free)


def test_each_adapter_lists_the_digest_its_requests_kv_keys_are_salted_with(llm, adapters):
    """What a worker tells a router (`LoraAdaptersResponse.digests`) to match an adapter's blocks in its
    KV events: the digest of the weights each served name runs with, one per distinct adapter."""
    engine = llm.engine
    digests = engine.lora_adapter_digests()
    served = engine.lora_adapters()
    assert set(digests) == set(served) and len(set(digests.values())) == len(digests)
    for name, path in served.items():
        assert digests[name] == engine.read_lora(path).digest


def test_unknown_and_bad_adapters_are_refused(llm, adapters, tmp_path):
    engine = llm.engine
    with pytest.raises(UnknownAdapterError, match="no-such"):
        engine.add_request("unknown", [1, 2, 3], greedy("no-such", 2))
    with pytest.raises(ValueError, match="no such directory"):
        engine.add_lora("missing", str(tmp_path / "missing"))
    too_big = {"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(too_big))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="above --max-lora-rank"):
        engine.add_lora("too-big", str(tmp_path))
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("attn-r8", str(adapters["mlp-r4"]))
    with pytest.raises(UnknownAdapterError):
        engine.remove_lora("no-such")
    assert set(engine.lora_adapters()) == {s.name for s in TINY_ADAPTERS}


def test_adapters_come_and_go_under_load(llm, adapters, assert_kv_all_free):
    """Requests of an adapter that is removed while they wait or run still finish with its
    weights; one added meanwhile serves at once; nothing compiles."""
    engine = llm.engine
    compiled = engine.num_compilations
    cases = [(n, p, t) for n, p, t in reference_runs() if n is not None]
    for i, (name, prompt, _) in enumerate(cases):
        engine.add_request(f"load-{i}", prompt, greedy(name, 16))
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        steps += 1
        if steps == 3:
            engine.remove_lora("attn-r8")
            engine.add_lora(EXTRA.name, str(adapters[EXTRA.name]))
            engine.add_request("late", [5, 6, 7, 8], greedy(EXTRA.name, 4))
            with pytest.raises(UnknownAdapterError):
                engine.add_request("gone", [1, 2], greedy("attn-r8", 2))
    for i, (_, _, new_ids) in enumerate(cases):
        assert outputs[f"load-{i}"] == new_ids
    assert len(outputs["late"]) == 4
    engine.remove_lora(EXTRA.name)
    engine.add_lora("attn-r8", str(adapters["attn-r8"]))
    assert engine.num_compilations == compiled
    check_all_free(llm, assert_kv_all_free)
