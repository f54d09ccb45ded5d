"""The KV disk tier with the tiny Gemma 3 vision-language model: blocks holding image rows are written
under content keys that cover the image's digest (its soft tokens salted by it), so after a restart
on the same directory the same prompt hits them on the disk and replies transformers' tokens
(tests/data/vlm_reference.json), while the same text with another image hits no block holding an
image row there and replies otherwise."""

from __future__ import annotations

import pytest
from test_vision_engine import CASES, ENGINE, greedy, prompt_of

from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve import LLM


def make(directory) -> LLM:
    disk = dict(kv_disk_dir=str(directory), kv_disk_bytes=16 << 20, kv_disk_min_load_tokens=8)
    return LLM(build_tiny_vlm(), **ENGINE, **disk)


def close(llm: LLM, assert_kv_all_free) -> None:
    assert_kv_all_free(llm.engine)
    assert not llm.engine.kv.loads.pending
    llm.close()  # writes what the disk lacks of the prefix cache, then waits for the writer


@pytest.mark.parametrize("name", ["one_image", "two_images"])
def test_image_blocks_hit_the_disk_after_a_restart_only_with_the_same_image(tmp_path, assert_kv_all_free, name):
    case = CASES[name]
    first = make(tmp_path)
    [out] = first.generate(prompt_of(first, case), greedy(len(case["new_ids"])), use_tqdm=False)
    assert out.outputs[0].token_ids == case["new_ids"]
    close(first, assert_kv_all_free)
    assert first.engine.snapshot().tiers.disk_written_blocks >= len(case["prompt_ids"]) // 8

    restarted = make(tmp_path)  # nothing on the device, the host or in the encoder cache
    prompt = prompt_of(restarted, case)
    [again] = restarted.generate(prompt, greedy(len(case["new_ids"])), use_tqdm=False)
    assert again.outputs[0].token_ids == case["new_ids"]
    full_blocks = (len(case["prompt_ids"]) - 1) // 8 * 8
    assert again.num_cached_tokens == full_blocks > prompt.images[-1].end
    assert restarted.engine.snapshot().tiers.disk_hit_tokens == full_blocks
    assert restarted.engine.runner.vision.cache.misses == 0  # every image row came from the disk

    other = {**case, "images": ["blue" if image != "blue" else "red" for image in case["images"]]}
    swapped = prompt_of(restarted, other)
    assert swapped.token_ids == prompt.token_ids  # the same tokens: only the images differ
    [changed] = restarted.generate(swapped, greedy(len(case["new_ids"])), use_tqdm=False)
    assert changed.num_cached_tokens <= swapped.images[0].start  # at most the text before the first image
    assert changed.outputs[0].token_ids != case["new_ids"]
    assert restarted.engine.snapshot().tiers.disk_hit_tokens == full_blocks  # no more disk hits
    close(restarted, assert_kv_all_free)
