"""Two in-process data-parallel replicas of the tiny Gemma 3 vision-language model: placement keys a
prompt as the replicas' prefix caches do, an image's rows salted by its digest, so a picture's chat
goes back to the replica holding its blocks, and the same text with another picture is not drawn
there by them. Both replicas run on the one default device (placement does not depend on where)."""

from __future__ import annotations

import numpy as np
import pytest
from test_vision_engine import CASES, ENGINE, greedy

from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.image_prompt import MultimodalPrompt, expand_images
from jaxserve.images import ImageInput


@pytest.fixture(scope="module")
def dp():
    model = build_tiny_vlm()
    engine = DataParallelEngine([LLMEngine(model, EngineConfig(**ENGINE)) for _ in range(2)])
    yield engine
    engine.close()


def picture_prompt(dp: DataParallelEngine, seed: int) -> MultimodalPrompt:
    """one_image's chat about a random picture (seed `seed`)."""
    replica = dp.replicas[0]
    pixels = np.random.default_rng(seed).uniform(-1, 1, (3, 32, 32)).astype(np.float32)
    text = replica.tokenizer.apply_chat_template(CASES["one_image"]["messages"], add_generation_prompt=True)
    return expand_images(text, [ImageInput.of(pixels)], replica.tokenizer, replica.vision)


def run(dp: DataParallelEngine, request_id: str, prompt) -> int:
    """The replica that ran the request to its end."""
    dp.add_request(request_id, prompt, greedy(2))
    where = next(i for i, r in enumerate(dp.replicas) if r.is_active(request_id))
    while dp.is_active(request_id):
        dp.step()
    return where


def test_a_picture_goes_back_to_the_replica_holding_its_blocks(dp, assert_kv_all_free):
    dp.add_request("busy", [2, 5, 6, 7], greedy(200))  # replica 0, the first of equals
    dp.step()
    assert dp.loads() == [1, 0]
    assert run(dp, "x", picture_prompt(dp, 1)) == 1  # the less loaded
    dp.abort("busy")
    assert dp.loads() == [0, 0]
    assert run(dp, "y", picture_prompt(dp, 2)) == 0  # the same text before the picture is too little to count
    assert run(dp, "x-again", picture_prompt(dp, 1)) == 1  # its blocks, image rows included, are there
    for replica in dp.replicas:
        assert_kv_all_free(replica)
