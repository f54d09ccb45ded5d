"""A prompt's images as the worker protocol carries them (`server.cluster.worker.wire`), for both vision
families' tiny models (Gemma 3: one image each; SmolVLM: tiles): the vision config and every image's
rows, digest and pixels cross unchanged, the router's salted ids are the engine's, and a worker refuses
images that do not fit the model or the prompt."""

from __future__ import annotations

import numpy as np
import pytest

from checkpoints.hf_vision import vision_from_json, vision_to_json
from checkpoints.tiny_smolvlm import build_tiny_smolvlm
from checkpoints.tiny_vlm import build_tiny_vlm
from jaxserve.image_prompt import cache_token_ids
from jaxserve.tokenizer import Tokenizer
from jaxserve.vision_inputs import expand_pictures, load_picture
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import cache_ids_of, images_from_messages, images_to_messages
from tests.data.vlm_images import image_png


@pytest.fixture(scope="module", params=[build_tiny_vlm, build_tiny_smolvlm], ids=["gemma3", "smolvlm"])
def prompt(request):
    model = request.param()
    vision, tokenizer = model.vision.config, Tokenizer(model.tokenizer_bundle)
    pictures = [load_picture(image_png(name), vision, 10**6) for name in ("red", "green")]
    placeholder = tokenizer.decode([vision.placeholder_token_id], skip_special_tokens=False)
    messages = [{"role": "user", "content": f"Compare {placeholder} with {placeholder} please."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return vision, expand_pictures(text, pictures, tokenizer, vision)


def test_images_cross_the_wire_unchanged(prompt):
    vision, sent = prompt
    assert vision_from_json(vision_to_json(vision)) == vision
    messages = images_to_messages(sent.images)
    got = images_from_messages(messages, sent.token_ids, vision)
    assert len(got) == len(sent.images) >= 2
    for a, b in zip(got, sent.images):
        assert (a.start, a.length, a.bidirectional, a.image.digest) == (
            b.start,
            b.length,
            b.bidirectional,
            b.image.digest,
        )
        assert np.array_equal(a.image.pixels, b.image.pixels)
    assert cache_ids_of(sent.token_ids, messages) == cache_token_ids(sent.token_ids, sent.images)
    assert cache_ids_of(sent.token_ids, messages) != sent.token_ids


def _with(m: pb.PromptImage, **changes: object) -> pb.PromptImage:
    return pb.PromptImage(**{**{f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}, **changes})


def test_a_worker_refuses_images_that_do_not_fit(prompt):
    vision, sent = prompt
    first, second = images_to_messages(sent.images)[:2]
    ids = sent.token_ids
    size = vision.image_size
    for messages, why in (
        ([_with(first, size=size + 1)], rf"pixels are not \[3, {size}, {size}\]"),
        ([_with(first, start=first.start - 1)], "are not its image tokens"),
        ([second, first], "are not its image tokens"),  # out of order
        ([_with(first, bidirectional=not first.bidirectional)], "bidirectional must be"),
        ([_with(first, digest=bytes(len(first.digest)))], "its digest is not its pixels'"),
    ):
        with pytest.raises(ValueError, match=why):
            images_from_messages(messages, ids, vision)
    with pytest.raises(ValueError, match="takes no images"):
        images_from_messages([first], ids, None)
