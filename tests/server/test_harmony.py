"""gpt-oss's harmony replies read into reasoning, content and tool calls (`server.harmony`): whole,
and streamed at every cut, where the events join into exactly the whole reply's parts and no
marker leaks."""

from __future__ import annotations

import random

import pytest

from checkpoints.tiny_random import build_tiny_tokenizer
from checkpoints.tokenizer_bundle import TokenizerBundle
from jaxserve.tokenizer import Tokenizer
from server.harmony import MESSAGE_ENDS, HarmonyStream, is_harmony_template, reasoning_tokens
from server.reply_setup import check_reasoning_parser
from server.tool_stream import Arguments, CallStart, Content, Reasoning

THOUGHT = "The user wants the weather. Use the tool."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
WEATHER_CALL = ("get_weather", '{"city": "Paris"}')
# (reply, has tools) -> (reasoning, content, calls)
CASES = [
    (ANALYSIS + FINAL, False, (THOUGHT, "It is sunny in Paris.", [])),
    (ANALYSIS + CALL, True, (THOUGHT, None, [WEATHER_CALL])),
    (ANALYSIS + PREAMBLE + CALL, True, (THOUGHT, "Checking.", [WEATHER_CALL])),
    # the recipient in the role part, before the channel
    (' to=functions.f<|channel|>commentary json<|message|>{"a": [1, 2]}', True, (None, None, [("f", '{"a": [1, 2]}')])),
    # no tools: a message to a function is content
    (ANALYSIS + CALL, False, (THOUGHT, '{"city":"Paris"}', [])),
    # a model that does not write harmony: all content, `<` and all
    ("Plain <b>text</b> to=x", True, (None, "Plain <b>text</b> to=x", [])),
    # a body that is not a JSON object is given as written
    ("<|channel|>commentary to=functions.g<|message|>city=Paris", True, (None, None, [("g", "city=Paris")])),
]


def read(text: str, calls: bool, cuts: list[int]):
    """The events of `text` read at each cut, then finished; and the whole reply's parts."""
    stream, events = HarmonyStream(calls), []
    for cut in cuts:
        events += stream.update(text[:cut])
    more, reasoning, reply = stream.finish(text, "stop")
    return events + more, (reasoning, reply.content, [(c.name, c.arguments) for c in reply.calls])


def joined(events) -> tuple:
    """What streamed events add up to, in the shape of the parts."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning)) or None
    content = "".join(e.text for e in events if isinstance(e, Content)) or None
    names = [e.name for e in events if isinstance(e, CallStart)]
    arguments = [
        "".join(e.text for e in events if isinstance(e, Arguments) and e.index == i) for i in range(len(names))
    ]
    return reasoning, content, list(zip(names, arguments))


@pytest.mark.parametrize("text,calls,expected", CASES)
def test_whole_and_streamed_at_every_cut(text, calls, expected):
    events, parts = read(text, calls, [len(text)])
    assert parts == expected
    every = list(range(1, len(text) + 1))
    rng = random.Random(len(text))
    chunked = sorted(rng.sample(every, len(text) // 7))
    for cuts in (every, chunked):
        events, parts = read(text, calls, cuts)
        assert parts == expected and joined(events) == expected
        assert not any("<|" in e.text for e in events if isinstance(e, Reasoning | Content))


def test_a_finish_reason_of_a_reply_with_calls_is_tool_calls_and_a_cut_one_keeps_length():
    assert HarmonyStream(True).finish(ANALYSIS + CALL, "stop")[2].finish_reason == "tool_calls"
    cut = ANALYSIS + CALL[:-6]
    events, reasoning, reply = HarmonyStream(True).finish(cut, "length")
    assert reply.finish_reason == "length" and reply.calls[0].arguments == '{"city":"P'
    # a header cut short is dropped
    assert HarmonyStream(False).finish(ANALYSIS + "<|start|>assistant<|chan", "length")[2].content == ""


def test_reasoning_tokens_are_the_analysis_messages():
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens(["<|start|>", "<|channel|>", "<|message|>", *MESSAGE_ENDS, "<|constrain|>"])
    tok = Tokenizer(TokenizerBundle(tokenizer, None, {}, ()))
    analysis, final = tok.encode(ANALYSIS), tok.encode(FINAL)
    assert reasoning_tokens(tok, analysis + final, calls=False) == len(analysis)
    assert reasoning_tokens(tok, analysis[:-3], calls=False) == len(analysis) - 3
    assert reasoning_tokens(tok, final, calls=False) == 0
    assert reasoning_tokens(tok, tok.encode("no harmony here"), calls=False) == 0


def test_templates_and_reasoning_parsers_must_agree():
    harmony = "<|start|>{{ m }}<|channel|>final<|message|>"
    assert is_harmony_template(harmony) and not is_harmony_template("<|im_start|>") and not is_harmony_template(None)
    check_reasoning_parser("openai_gptoss", harmony)
    check_reasoning_parser(None, harmony)
    check_reasoning_parser("qwen3", "<think>")
    with pytest.raises(ValueError, match="cannot read it"):
        check_reasoning_parser("deepseek_r1", harmony)
    with pytest.raises(ValueError, match="does not write them"):
        check_reasoning_parser("openai_gptoss", "{{ messages }}")
