"""The host side of LoRA serving, without a device: PEFT adapters read into the runner's layout
(transposed, scaled, rank-padded; refused when they cannot be served exactly), and `LoraManager`'s
names, host copies and LoRA slots (LRU reuse of unpinned LoRA slots, waiting when all are pinned)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from config_harness import resolved
from lora_harness import TINY_ADAPTERS, write_tiny_adapters
from safetensors.numpy import load_file

from checkpoints.tiny_random import tiny_random_config
from jaxserve.lora.manager import LoraManager
from jaxserve.lora.peft import load_peft_adapter

CONFIG = tiny_random_config()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_tiny_adapters(tmp_path_factory.mktemp("adapters"))


def manager(writes: list, max_loras: int = 2, max_cpu_loras: int = 2) -> LoraManager:
    return LoraManager(
        CONFIG, max_loras, max_cpu_loras, 16, lambda lora_slot, weights: writes.append((lora_slot, weights))
    )


def test_peft_tensors_become_scaled_transposed_padded_stacks(adapters):
    spec = next(s for s in TINY_ADAPTERS if s.rslora)
    weights = load_peft_adapter(str(adapters[spec.name]), CONFIG, max_rank=16)
    tensors = load_file(str(adapters[spec.name] / "adapter_model.safetensors"))
    a, b = weights.modules["q_proj"]
    assert a.shape == (CONFIG.num_layers, CONFIG.hidden_size, 16) and b.shape[1] == 16
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    np.testing.assert_array_equal(a[1, :, : spec.rank], tensors[f"{prefix}.lora_A.weight"].T)
    scaling = spec.alpha / math.sqrt(spec.rank)  # rsLoRA
    np.testing.assert_allclose(b[1, : spec.rank], tensors[f"{prefix}.lora_B.weight"].T * scaling, rtol=1e-6)
    assert not a[:, :, spec.rank :].any() and not b[:, spec.rank :].any()  # padding adds nothing
    assert set(weights.modules) == set(spec.targets)


def test_adapters_that_cannot_be_served_exactly_are_refused(adapters, tmp_path):
    source = adapters["attn-r8"]
    config = json.loads((source / "adapter_config.json").read_text())
    for change, message in (
        ({"r": 32}, "above --max-lora-rank"),
        ({"use_dora": True}, "use_dora"),
        ({"target_modules": ["embed_tokens"]}, "cannot target"),
        ({"peft_type": "IA3"}, "not a LoRA adapter"),
        ({"r": 4}, "has shape"),
    ):
        directory = tmp_path / message.replace(" ", "_")
        directory.mkdir()
        (directory / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
        (directory / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_peft_adapter(str(directory), CONFIG, max_rank=16)


def test_regex_target_modules_select_their_projections(adapters, tmp_path):
    source = adapters["mlp-r4"]
    (tmp_path / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    config = json.loads((source / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r".*\.mlp\..*_proj"}))
    assert set(load_peft_adapter(str(tmp_path), CONFIG, max_rank=16).modules) == {"gate_proj", "up_proj", "down_proj"}


def test_lora_slots_are_reused_least_recently_used_first_and_never_while_pinned(adapters):
    writes: list = []
    lora = manager(writes)
    for spec in TINY_ADAPTERS[:3]:
        lora.add(spec.name, str(adapters[spec.name]))
    a, b, c = (lora.resolve(s.name) for s in TINY_ADAPTERS[:3])
    assert lora.acquire(a) == 0 and lora.acquire(b) == 1
    assert lora.acquire(c) is None  # both LoRA slots pinned: the request waits
    lora.release(0)
    assert lora.acquire(c) == 0 and [s for s, _ in writes] == [0, 1, 0]  # a's unpinned LoRA slot, written again
    assert lora.acquire(b) == 1 and len(writes) == 3  # resident: no write
    lora.release(1)
    lora.release(1)
    lora.release(0)
    assert lora.num_pinned == 0 and lora.num_resident == 2
    assert lora.acquire(a) == 0  # LoRA slot 0 was used longer ago than LoRA slot 1
    lora.release(0)
    with pytest.raises(ValueError, match="not pinned"):
        lora.release(0)


def test_host_copies_are_bounded_and_the_same_bytes_keep_their_uid(adapters):
    lora = manager([], max_cpu_loras=2)
    for spec in TINY_ADAPTERS[:3]:
        lora.add(spec.name, str(adapters[spec.name]))
    assert lora.stats.disk_loads == 3  # each read once when added; the first was dropped
    first = lora.resolve(TINY_ADAPTERS[0].name)
    assert lora.stats.disk_loads == 4
    lora.add("alias", str(adapters[TINY_ADAPTERS[0].name]))
    assert lora.resolve("alias").uid == first.uid  # the same bytes share cached KV under any name
    assert lora.resolve(TINY_ADAPTERS[1].name).uid != first.uid
    assert first.salt(7) != lora.resolve(TINY_ADAPTERS[1].name).salt(7) and first.salt(7) < 0
    lora.remove("alias")
    with pytest.raises(KeyError):
        lora.resolve("alias")
    with pytest.raises(ValueError, match="already loaded"):
        lora.add(TINY_ADAPTERS[0].name, str(adapters[TINY_ADAPTERS[1].name]))


def test_content_keys_of_an_adapter_differ_from_the_base_models_and_repeat_for_its_bytes():
    """The disk tier's keys: the chain of an adapter's request is seeded with its digest."""
    from jaxserve.kv.content_keys import KEY_BYTES, ChainKeys

    base = ChainKeys(bytes(KEY_BYTES), 4)
    tokens = list(range(12))
    adapter = base.salted(b"digest-of-adapter-a")
    assert set(adapter.keys(tokens, 3)).isdisjoint(base.keys(tokens, 3))
    assert base.salted(b"digest-of-adapter-a").keys(tokens, 3) == adapter.keys(tokens, 3)
    assert base.salted(b"digest-of-adapter-b").keys(tokens, 3) != adapter.keys(tokens, 3)


def test_a_request_waiting_for_a_lora_slot_is_not_starved_by_a_resident_adapter(adapters):
    """One LoRA slot: adapter a runs; b waits for the LoRA slot; a later request of a (resident) waits
    behind b instead of extending a's pin, and b runs as soon as a's first request ends."""
    from jaxserve.kv import build_kv_manager
    from jaxserve.outputs import FinishReason
    from jaxserve.request import Request
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.scheduler import Scheduler

    lora = manager([], max_loras=1)
    first, second = TINY_ADAPTERS[0].name, TINY_ADAPTERS[1].name
    for name in (first, second):
        lora.add(name, str(adapters[name]))
    config = resolved(
        block_size=4,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_table_buckets=(16,),
        enable_lora=True,
        max_loras=1,
    )
    scheduler = Scheduler(config, build_kv_manager(64, 4, watermark_blocks=0), lora)
    requests = {
        rid: Request(rid, [3, 4, 5, 6, 7], SamplingParams(max_tokens=8), seed=0, adapter=lora.resolve(name))
        for rid, name in (("a1", first), ("b1", second), ("a2", first))
    }
    for request in requests.values():
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.prefills] == ["a1"] and requests["a1"].lora_slot == 0
    scheduler.on_step_launched(out)
    assert requests["a2"].lora_slot == -1  # behind b1, though its adapter is resident
    scheduler.finish(requests["a1"], FinishReason.LENGTH)
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.prefills] == ["b1"]
    scheduler.finish(requests["b1"], FinishReason.ABORT)
    assert [c.request.request_id for c in scheduler.schedule().prefills] == ["a2"]
    scheduler.finish(requests["a2"], FinishReason.ABORT)
    assert lora.num_pinned == 0 and lora.num_resident == 1
