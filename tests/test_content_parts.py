"""Chat templates that read message content only as parts (SmolVLM's) get a string content as its
parts, an image part where `<image>` stands; templates that take strings get the string."""

from __future__ import annotations

import dataclasses

from checkpoints.architectures import gemma3
from checkpoints.tiny_random import CHATML_TEMPLATE
from checkpoints.tiny_smolvlm import CHAT_TEMPLATE, build_tiny_smolvlm
from jaxserve.content_parts import as_parts, reads_parts
from jaxserve.tokenizer import Tokenizer

# The chat template of SmolVLM checkpoints on the Hub (transformers' `processing_smolvlm.DEFAULT_CHAT_TEMPLATE`).
SMOLVLM_HUB_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_only_templates_that_loop_over_content_without_a_string_test_read_parts():
    assert reads_parts(SMOLVLM_HUB_TEMPLATE)
    assert not any(reads_parts(t) for t in (CHATML_TEMPLATE, CHAT_TEMPLATE, gemma3.CHAT_TEMPLATE))


def test_a_string_is_split_at_its_images():
    assert as_parts("<image>What? <image>", images=True) == [
        {"type": "image"},
        {"type": "text", "text": "What? "},
        {"type": "image"},
    ]
    assert as_parts("<image>What?", images=False) == [{"type": "text", "text": "<image>What?"}]


def test_the_hub_template_renders_a_string_content_as_its_parts():
    bundle = build_tiny_smolvlm().tokenizer_bundle
    tokenizer = Tokenizer(dataclasses.replace(bundle, chat_template=SMOLVLM_HUB_TEMPLATE))
    messages = [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A cat."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|im_start|>User:<image>What?<end_of_utterance>\nAssistant: A cat.<end_of_utterance>\nAssistant:"
