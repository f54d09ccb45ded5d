"""Streamed tool calls and reasoning, without an engine: `stable_json` rewrites JSON prefixes into
the non-streamed form; for every tool format (Hermes/Qwen, Llama 3, Mistral, a forced named
function, "required"), a reply fed piece by piece streams each call's name, then argument
fragments that join into the non-streamed call, for parallel calls too; reasoning parsers split
`<think>` blocks streamed and not, and tool calls after reasoning are calls, inside it reasoning."""

from __future__ import annotations

import json
import random
import time

import pytest

from server.partial_json import StableJson, stable_json
from server.reasoning import ReasoningParser
from server.reply_stream import ReplyParsing
from server.tool_stream import Arguments, CallStart, Content, Reasoning
from server.tools import ToolCalling, ToolChoice, ToolFormat

HERMES = ToolFormat("{% for m in messages %}{{ m['content'] }}{% endfor %}")
LLAMA3 = ToolFormat("{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>")
MISTRAL = ToolFormat("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}[TOOL_CALLS]")
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
    "count": {"type": "object", "properties": {"n": {"type": "integer"}, "word": {"type": "string"}}},
}
FUNCTIONS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()]
PYTHONIC = ToolFormat("{% if tools %}Reply [func_name1(params_name1=params_value1), func_name2(params)]{% endif %}")
QWEN3_CODER = ToolFormat("{% if tools %}<tools>...<function=example><parameter=example>{% endif %}", FUNCTIONS)

DOCUMENTS = [
    '{"city":"Paris","n":1.50,"ok":true,"x":null,"l":[1, 2,{"a":"b\\u00e9\\n\\ud83d\\ude00"}],"e":{}}',
    '{ "a" : "x\\"y" , "b":-12e3 , "c": [ ] }',
    "{}",
    '{"k": "caf\u00e9 \\\\ ok", "nested": {"deep": {"deeper": [true, false]}}}',
]


@pytest.mark.parametrize("raw", DOCUMENTS)
def test_stable_json_prefixes_only_grow_and_end_as_json_dumps(raw):
    whole = json.dumps(json.loads(raw), ensure_ascii=False)
    previous = ""
    for end in range(len(raw) + 1):
        shown = stable_json(raw[:end])
        assert shown.startswith(previous) and whole.startswith(shown), (raw[:end], shown)
        previous = shown
    assert previous == whole
    assert stable_json(raw + "\n</tool_call>") == whole  # what follows the value is not part of it


def stream_events(parsing: ReplyParsing, text: str, step: int = 3, finish: str = "stop"):
    """The events of `text` fed `step` characters at a time, and the non-streamed parts."""
    stream, events = parsing.stream(), []
    for end in range(step, len(text), step):
        events += stream.update(text[:end])
    last, parts = stream.finish(text, finish)
    return events + last, parts, parsing.parts(text, finish)


def joined(events):
    """(reasoning, content, [(name, arguments)]) as a client accumulates the events."""
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls)  # calls start in order, each once
            calls.append([e.name, ""])
        elif isinstance(e, Arguments):
            calls[e.index][1] += e.text
    return reasoning, content, [tuple(c) for c in calls]


TWO_CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris"})]


@pytest.mark.parametrize(
    "tool_format,choice,text",
    [
        (
            HERMES,
            ToolChoice("auto"),
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
        ),
        (
            LLAMA3,
            ToolChoice("auto"),
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {"zone":"Europe/Paris"}}',
        ),
        (
            MISTRAL,
            ToolChoice("auto"),
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
        ),
        (
            HERMES,
            ToolChoice("required"),
            '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}]',
        ),
        (
            QWEN3_CODER,
            ToolChoice("auto"),
            "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>",
        ),
        (
            PYTHONIC,
            ToolChoice("auto"),
            '[get_weather(city="Paris", unit="celsius"), get_time(zone="Europe/Paris")]',
        ),
    ],
    ids=["hermes", "llama3", "mistral", "required", "qwen3_coder", "pythonic"],
)
def test_parallel_calls_stream_name_first_then_fragments_that_join_into_the_whole_call(tool_format, choice, text):
    parsing = ReplyParsing(ToolCalling(tool_format, choice))
    events, streamed_parts, whole = stream_events(parsing, text)
    _, content, calls = joined(events)
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert [(name, json.loads(arguments)) for name, arguments in calls] == TWO_CALLS
    assert content == (whole.content or "") and streamed_parts == whole
    assert whole.finish_reason == "tool_calls"
    first_arguments = [i for i, e in enumerate(events) if isinstance(e, Arguments) and e.index == 0]
    second_start = next(i for i, e in enumerate(events) if isinstance(e, CallStart) and e.index == 1)
    assert len(first_arguments) >= 2 and first_arguments[0] < second_start  # streamed before the next call


def test_pythonic_text_that_is_no_call_is_content():
    parsing = ReplyParsing(ToolCalling(PYTHONIC, ToolChoice("auto")))
    for text in ["[Note] It is sunny.", "Sunny [f(x=1)]", "[1, 2]"]:
        events, _, whole = stream_events(parsing, text, step=1)
        assert (whole.content, whole.calls) == (text, []) and joined(events) == ("", text, [])


def test_qwen3_coder_parameters_are_typed_by_the_schema():
    text = "<tool_call>\n<function=count>\n<parameter=n>\n42\n</parameter>\n<parameter=word>\n7\n</parameter>\n"
    parsing = ReplyParsing(ToolCalling(QWEN3_CODER, ToolChoice("auto")))
    events, _, whole = stream_events(parsing, text + "</function>\n</tool_call>", step=1)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("count", {"n": 42, "word": "7"})]
    assert joined(events)[2] == [("count", whole.calls[0].arguments)]
    assert QWEN3_CODER.parse(text) == (text, [])  # a function never closed is not a call


def test_a_forced_function_streams_its_arguments_from_the_first_token():
    parsing = ReplyParsing(ToolCalling(HERMES, ToolChoice("function", "get_weather")))
    text = '{"city": "Paris", "unit": "celsius"}'
    events, _, whole = stream_events(parsing, text, step=1)
    assert events[0] == CallStart(0, "get_weather")
    assert isinstance(events[1], Arguments) and events[1].text == "{"
    assert joined(events)[2] == [("get_weather", whole.calls[0].arguments)] and whole.finish_reason == "stop"


def test_a_call_cut_by_length_streams_what_the_whole_reply_holds():
    parsing = ReplyParsing(ToolCalling(HERMES, ToolChoice("function", "f")))
    events, _, whole = stream_events(parsing, '{"city": "Par', finish="length")
    assert joined(events)[2] == [("f", '{"city": "Par')] == [(c.name, c.arguments) for c in whole.calls]
    assert whole.finish_reason == "length"


def test_text_that_only_looks_like_a_call_start_is_content_at_the_end():
    parsing = ReplyParsing(ToolCalling(HERMES, ToolChoice("auto")))
    events, _, whole = stream_events(parsing, "I like <tool", step=1)
    assert joined(events) == ("", "I like <tool", []) and whole.content == "I like <tool"


class _Tokenizer:
    """Characters as tokens: enough to count reasoning tokens and read a prompt's tail."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def parser(name: str, prompt: str = "user: hi\nassistant: ") -> ReasoningParser:
    return ReasoningParser.for_prompt(name, _Tokenizer(), [ord(c) for c in prompt])


@pytest.mark.parametrize(
    "name,prompt,text,want",
    [
        ("qwen3", "", "<think>\nsunny, so say so\n</think>\n\nIt is sunny.", ("\nsunny, so say so\n", "It is sunny.")),
        ("qwen3", "", "It is sunny.", (None, "It is sunny.")),  # no think block: all content
        ("qwen3", "assistant: <think>\n", "sunny</think>It is sunny.", ("sunny", "It is sunny.")),  # prompt opened it
        ("qwen3", "<think>\n\n</think>\n\n", "It is sunny.", (None, "It is sunny.")),  # enable_thinking false
        ("deepseek_r1", "", "sunny</think>\nIt is sunny.", ("sunny", "It is sunny.")),
        ("deepseek_r1", "", "still thinking", ("still thinking", "")),  # never closed: all reasoning
    ],
)
def test_reasoning_splits_streamed_and_not(name, prompt, text, want):
    parsing = ReplyParsing(None, parser(name, prompt))
    for step in (1, 2, 5):
        events, _, whole = stream_events(parsing, text, step=step)
        reasoning, content, _ = joined(events)
        assert (whole.reasoning, whole.content) == want
        assert (reasoning or None, content) == (whole.reasoning, whole.content)
    tokens = [ord(c) for c in text]
    counted = parsing.reasoning_tokens(_Tokenizer(), tokens)
    if want[0] is None:
        assert counted == 0
    else:
        assert counted == (text.index("</think>") + len("</think>") if "</think>" in text else len(text))


def test_tool_calls_after_reasoning_are_calls_and_inside_it_are_reasoning():
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    parsing = ReplyParsing(ToolCalling(HERMES, ToolChoice("auto")), parser("qwen3"))
    events, _, whole = stream_events(parsing, f"<think>maybe {call}? no</think>\n{call}")
    assert whole.reasoning == f"maybe {call}? no" and whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_time", {"zone": "UTC"})]
    reasoning, content, calls = joined(events)
    assert reasoning == whole.reasoning and calls == [("get_time", whole.calls[0].arguments)]


@pytest.mark.parametrize("raw", DOCUMENTS + ['"top \\ud83d\\ude00 level"', '[1, "a\\\\b", {"q": "\\ud83d"}]'])
def test_stable_json_read_piece_by_piece_is_stable_json_of_each_prefix(raw):
    rng = random.Random(raw)
    for _ in range(20):
        form, shown, end = StableJson(), "", 0
        while end < len(raw):
            end = min(len(raw), end + rng.randint(1, 7))
            shown += form.more(raw[:end])
            assert shown == stable_json(raw[:end]), raw[:end]


def test_a_raw_control_character_in_a_string_ends_what_is_stable_instead_of_failing():
    assert stable_json('{"code": "a\nb"}') == '{"code": "'


def test_a_delta_costs_the_same_at_the_end_of_a_long_reply_as_near_its_start():
    """Each delta is read once: at 40 times the length, a delta costs about the same (before, the
    whole reply was parsed again at every delta: 30-100 times more)."""
    word = "lorem ipsum dolor "
    cases = {
        "reasoning": (ReplyParsing(None, ReasoningParser("qwen3", opened=True)), ""),
        "text, tools offered": (ReplyParsing(ToolCalling(HERMES, ToolChoice("auto"))), ""),
        "forced call": (ReplyParsing(ToolCalling(HERMES, ToolChoice("function", "get_weather"))), '{"city": "'),
        "hermes call": (
            ReplyParsing(ToolCalling(HERMES, ToolChoice("auto"))),
            '<tool_call>\n{"name": "f", "arguments": {"a": "',
        ),
    }

    def per_delta(parsing: ReplyParsing, text: str) -> float:
        stream, ends = parsing.stream(), range(4, len(text), 4)
        for end in ends[:-100]:
            stream.update(text[:end])
        prefixes = [text[:end] for end in ends[-100:]]
        start = time.perf_counter()
        for prefix in prefixes:
            stream.update(prefix)
        return time.perf_counter() - start

    for name, (parsing, head) in cases.items():
        short = min(per_delta(parsing, head + word * 150) for _ in range(3))
        long = min(per_delta(parsing, head + word * 6000) for _ in range(3))
        assert long < 4 * short + 0.002, (name, short, long)
