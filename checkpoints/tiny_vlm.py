"""`tiny-random` Gemma 3 with a vision tower: the tiny vision-language model of the tests.

The language model is the tiny Gemma 3 of `tiny_random.TINY_FAMILIES`; the tokenizer is the tiny
byte-level BPE plus Gemma's turn and image markers as special tokens; the vision tower is a
2-layer SigLIP over 32x32 images of 4x4 patches, pooled to 16 soft tokens. Every weight is drawn
from its declaration with the seed, as for the text families, so no weights are committed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenizers import AddedToken

from checkpoints.architectures import gemma3, gemma3_vision
from checkpoints.loaded import LoadedModel, VisionTower
from checkpoints.params import resolve_dtype
from checkpoints.tiny_random import build_tiny_random
from checkpoints.weights import random_tree

TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
VOCAB_SIZE = 320


# The tiny SigLIP tower's shape, shared by the tiny vision-language models (this one and `tiny_smolvlm`).
TINY_TOWER = dict(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=32, patch_size=4, layer_norm_eps=1e-6
)


def tiny_vision_config(text_hidden_size: int, first_image_token: int) -> gemma3_vision.VisionConfig:
    boi, eoi, soft = range(first_image_token, first_image_token + 3)
    return gemma3_vision.VisionConfig(
        **TINY_TOWER,
        mm_tokens_per_image=16,
        text_hidden_size=text_hidden_size,
        boi_token_id=boi,
        eoi_token_id=eoi,
        image_token_id=soft,
    )


def build_tiny_vlm(dtype: Any = "float32", seed: int = 0) -> LoadedModel:
    """The tiny Gemma 3 vision-language model: text model, tokenizer, chat template and vision tower."""
    text = build_tiny_random(dtype, seed, family="gemma3", vocab_size=VOCAB_SIZE)
    tokenizer = text.tokenizer_bundle.tokenizer
    first = tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in TURN_TOKENS + IMAGE_TOKENS])
    end_of_turn = tokenizer.token_to_id(gemma3.ARCHITECTURE.end_of_turn)
    vision = tiny_vision_config(text.config.hidden_size, first + len(TURN_TOKENS))
    bundle = dataclasses.replace(
        text.tokenizer_bundle,
        chat_template=gemma3.CHAT_TEMPLATE,
        eos_token_ids=(*text.config.eos_token_ids, end_of_turn),
    )
    params = random_tree(gemma3_vision.weights(vision), seed, resolve_dtype(dtype))
    return LoadedModel(text.config, text.params, bundle, VisionTower(vision, params))
