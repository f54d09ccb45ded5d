"""The disk tier in the engine (tiny random model): greedy outputs are the same with it on and
off, after a restart on the same directory, and after a damaged file; a second engine on the
same directory hits what the first computed; a clean close writes the prefix cache the disk lacks;
a request waiting for a slow disk does not hold up the others."""

from __future__ import annotations

import threading

import pytest
from tier_engines import GREEDY, random_prompts, run, tier_llm

from jaxserve import LLM, SamplingParams
from jaxserve.kv import disk_tier

PROMPTS = random_prompts(150, 97, 40)


def make(disk_dir=None, **overrides) -> LLM:
    extra = {"kv_disk_dir": str(disk_dir), "kv_disk_bytes": 64 << 20} if disk_dir is not None else {}
    return tier_llm(**{**extra, **overrides})


def close(llm: LLM, assert_kv_all_free) -> None:
    engine = llm.engine
    assert_kv_all_free(engine)
    assert not engine.kv.loads.pending and not engine.kv.tier_link.held_host_slots()
    llm.close()  # writes what the disk lacks of the prefix cache, then waits for the writer


@pytest.fixture(scope="module")
def reference():
    return run(make(), PROMPTS)[0]


def test_outputs_equal_with_the_disk_tier_on_off_and_after_a_restart(tmp_path, reference, assert_kv_all_free):
    first = make(tmp_path)
    assert run(first, PROMPTS)[0] == reference
    close(first, assert_kv_all_free)
    stats = first.engine.snapshot().tiers
    assert stats.disk_written_blocks >= (150 + 97 + 40) // 8 and stats.disk_files == stats.disk_written_blocks

    second = make(tmp_path)  # a restart: nothing on the device or the host
    tokens, cached = run(second, PROMPTS)
    assert tokens == reference
    assert cached[0] == 144 and cached[1] == 96  # full blocks, last prompt token computed
    tiers = second.engine.snapshot().tiers
    assert tiers.disk_hit_tokens >= 144 + 96 and tiers.disk_loads >= 2 and tiers.disk_bytes_read > 0
    assert second.engine.stats.prompt_tokens_computed < 150 + 97 + 40 - 200
    close(second, assert_kv_all_free)


def test_a_clean_close_writes_the_prefix_cache_and_the_restart_hits_it(tmp_path, reference, assert_kv_all_free):
    first = make(tmp_path, kv_disk_write_through_hits=1000)  # nothing reaches the disk while it runs
    assert run(first, PROMPTS)[0] == reference
    assert first.engine.snapshot().tiers.disk_written_blocks == 0
    close(first, assert_kv_all_free)
    written = first.engine.snapshot().tiers.disk_written_blocks
    assert written >= (150 + 97 + 40) // 8 and written == len(list(tmp_path.glob("*/*/*.kvb")))

    second = make(tmp_path, kv_disk_write_through_hits=1000)
    tokens, cached = run(second, PROMPTS)
    assert tokens == reference
    assert cached[0] == 144 and cached[1] == 96
    assert second.engine.snapshot().tiers.disk_hit_tokens >= 144 + 96
    close(second, assert_kv_all_free)
    assert second.engine.snapshot().tiers.disk_written_blocks == 0  # it had nothing the disk lacked


def test_a_damaged_file_is_recomputed_and_outputs_do_not_change(tmp_path, reference, assert_kv_all_free):
    first = make(tmp_path)
    run(first, PROMPTS)
    close(first, assert_kv_all_free)
    files = sorted(tmp_path.glob("*/*/*.kvb"))
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    second = make(tmp_path)
    tokens, cached = run(second, PROMPTS)
    assert tokens == reference
    tiers = second.engine.snapshot().tiers
    # Undamaged, the restart hits every full prompt block (144 + 96 + 32 tokens); the damaged file's
    # block (8 tokens), wherever its chain, and any after it are recomputed instead.
    assert tiers.disk_damaged == 1 and tiers.disk_hit_tokens <= 144 + 96 + 32 - 8
    close(second, assert_kv_all_free)
    assert second.engine.snapshot().tiers.disk_written_blocks == 1  # the recomputed block, written again
    assert victim.read_bytes() != bytes(data)


def test_a_second_engine_on_the_directory_hits_what_the_first_computed(tmp_path, reference, assert_kv_all_free):
    a, b = make(tmp_path), make(tmp_path)  # both started before anything was written
    run(a, PROMPTS[:1])
    a.engine.step()  # the last planned writes
    a.engine.lower_tier.flush()
    tokens, cached = run(b, PROMPTS[:1])
    assert tokens == reference[:1] and cached == [144]
    close(a, assert_kv_all_free)
    close(b, assert_kv_all_free)


def test_a_request_loading_from_disk_does_not_stall_the_others(tmp_path, reference, monkeypatch, assert_kv_all_free):
    first = make(tmp_path)
    run(first, PROMPTS[:1])
    close(first, assert_kv_all_free)
    gate = threading.Event()  # a slow disk: no file is read until the gate opens
    read_block = disk_tier.read_block
    monkeypatch.setattr(disk_tier, "read_block", lambda *args: gate.wait(120) and read_block(*args))
    llm = make(tmp_path)
    engine = llm.engine
    tokens: dict[str, list[int]] = {"other": [], "loaded": []}
    cached = {}

    def step() -> None:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            if d.usage is not None:
                cached[d.request_id] = d.usage.cached_tokens

    try:
        engine.add_request("other", PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        while not tokens["other"]:
            step()
        (loading,) = engine.add_request("loaded", PROMPTS[0], GREEDY)
        before = len(tokens["other"])
        for _ in range(6):
            step()
            assert engine.kv.loads.is_loading(loading)
        assert len(tokens["other"]) - before >= 5  # decoding went on while the load waited for the disk
    finally:
        gate.set()
    while engine.has_unfinished_requests():
        step()
    assert tokens["loaded"] == reference[0] and cached["loaded"] == 144
    close(llm, assert_kv_all_free)


def test_short_disk_hits_are_recomputed(tmp_path, assert_kv_all_free):
    first = make(tmp_path)
    run(first, PROMPTS[2:])
    close(first, assert_kv_all_free)
    second = make(tmp_path, kv_disk_min_load_tokens=64)  # the hit is 40 tokens: not worth a load
    _, cached = run(second, PROMPTS[2:])
    assert cached == [0] and second.engine.snapshot().tiers.disk_loads == 0
    close(second, assert_kv_all_free)


def test_bad_disk_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="prefix"):
        make(tmp_path, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_disk_bytes"):
        make(tmp_path, kv_disk_bytes=0)
    with pytest.raises(ValueError, match="kv_disk_min_load_tokens"):
        make(tmp_path, kv_disk_min_load_tokens=-1)


def test_an_adapters_prefix_is_a_disk_hit_after_a_restart_that_numbers_its_adapters_otherwise(
    tmp_path, assert_kv_all_free
):
    """Each engine numbers its adapters in the order their first requests come (the prefix cache
    salts a LoRA prompt's first token with that number); the disk tier keys an adapter's blocks by
    its weights instead, so a restart that meets the adapters in the other order still hits."""
    from lora_harness import LORA_ENGINE, TINY_ADAPTERS, write_tiny_adapters

    adapters = write_tiny_adapters(tmp_path / "adapters")
    first_name, second_name = TINY_ADAPTERS[0].name, TINY_ADAPTERS[1].name
    lora = {k: v for k, v in LORA_ENGINE.items() if k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")}

    def engine() -> LLM:
        llm = make(tmp_path / "kv", **lora)
        for spec in TINY_ADAPTERS[:2]:
            llm.engine.add_lora(spec.name, str(adapters[spec.name]))
        return llm

    def complete(llm: LLM, name: str | None, prompt: list[int]):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora=name)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    before = engine()
    want, cached = complete(before, first_name, PROMPTS[1])  # the adapter numbered 1 here
    assert cached == 0
    close(before, assert_kv_all_free)
    after = engine()
    complete(after, second_name, PROMPTS[2])  # the other adapter takes number 1 after the restart
    assert complete(after, None, PROMPTS[1])[1] == 0  # the base model never reads the adapter's KV
    assert complete(after, first_name, PROMPTS[1]) == (want, 96)
    assert after.engine.snapshot().tiers.disk_hit_tokens >= 96
    close(after, assert_kv_all_free)
