"""`tiny-random` SmolVLM: the tiny Idefics3 / SmolVLM vision-language model of the tests.

The language model is the tiny Llama of `tiny_random.TINY_FAMILIES`; the tokenizer is the tiny
byte-level BPE plus SmolVLM's special tokens (`<end_of_utterance>`, the image markers and the
`<row_r_col_c>` tile names); the vision tower is a 2-layer SigLIP over 32x32 tiles of 4x4 patches,
pixel-shuffled by 4 to 4 tokens a tile. The processor resizes an image's longest edge to 80
pixels and splits it, so the test images take 2 x 3 or 3 x 3 tiles and a global one. Every weight
is drawn from its declaration with the seed, as for the text families, so no weights are committed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenizers import AddedToken

from checkpoints.architectures import idefics3_vision
from checkpoints.loaded import LoadedModel, VisionTower
from checkpoints.params import resolve_dtype
from checkpoints.tiny_random import build_tiny_random
from checkpoints.tiny_vlm import TINY_TOWER
from checkpoints.weights import random_tree

END_OF_UTTERANCE = "<end_of_utterance>"
IMAGE_TOKEN = "<image>"
MAX_TILES_PER_SIDE = 6  # `<row_r_col_c>` tokens for r, c up to this (as SmolVLM's tokenizer)
VOCAB_SIZE = 352
# SmolVLM's chat template, for content that is a string (the server renders image parts as `<image>`).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{{ ':' if message['content'].startswith('<image>') else ': ' }}{{ message['content'] }}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def special_tokens() -> list[str]:
    """SmolVLM's added tokens, in the order the tiny tokenizer numbers them."""
    tiles = [f"<row_{r}_col_{c}>" for r in range(1, MAX_TILES_PER_SIDE + 1) for c in range(1, MAX_TILES_PER_SIDE + 1)]
    return [END_OF_UTTERANCE, "<fake_token_around_image>", "<global-img>", IMAGE_TOKEN, *tiles]


def tiny_vision_config(text_hidden_size: int, image_token_id: int) -> idefics3_vision.VisionConfig:
    return idefics3_vision.VisionConfig(
        **TINY_TOWER,
        scale_factor=4,
        text_hidden_size=text_hidden_size,
        image_token_id=image_token_id,
        model_type="smolvlm",
        longest_edge=80,
        do_image_splitting=True,
    )


def build_tiny_smolvlm(dtype: Any = "float32", seed: int = 0) -> LoadedModel:
    """The tiny SmolVLM: Llama text model, tokenizer, chat template and vision tower."""
    text = build_tiny_random(dtype, seed, family="llama", vocab_size=VOCAB_SIZE)
    tokenizer = text.tokenizer_bundle.tokenizer
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special_tokens()])
    end = tokenizer.token_to_id(END_OF_UTTERANCE)
    vision = tiny_vision_config(text.config.hidden_size, tokenizer.token_to_id(IMAGE_TOKEN))
    bundle = dataclasses.replace(
        text.tokenizer_bundle, chat_template=CHAT_TEMPLATE, eos_token_ids=(*text.config.eos_token_ids, end)
    )
    params = random_tree(idefics3_vision.weights(vision), seed, resolve_dtype(dtype))
    return LoadedModel(text.config, text.params, bundle, VisionTower(vision, params))
