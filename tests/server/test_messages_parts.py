"""The Messages API's reply builder (`server.messages_reply.MessageReply`) on deltas as the engine
sends them, cut at awkward places: with tools on auto, text is shown up to where a call starts and the
call becomes a tool_use block; a call forced by name streams its input; stop sequences are cut and
named; the events accumulate (as the SDK accumulates them) to the message that was not streamed.
Pings on an idle stream (a real aiohttp server). And the request checks that need no server:
conversions of blocks to chat messages."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from jaxserve.outputs import Delta
from server import routes_messages
from server.errors import APIError
from server.messages_reply import MessageReply
from server.messages_request import parse_conversation, parse_messages_request
from server.openai_bodies import UsageCount
from server.reasoning import ReasoningParser
from server.reply_stream import ReplyParsing
from server.tools import ToolCalling, ToolChoice, ToolFormat

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _deltas(pieces: list[str], finish: str) -> list[Delta]:
    last = len(pieces) - 1
    return [Delta("m", 0, text, [7], None, finish if i == last else None, None) for i, text in enumerate(pieces)]


def _run(reply: MessageReply, pieces: list[str], finish: str = "stop") -> tuple[list[dict], dict]:
    usage = UsageCount(prompt_tokens=10, completion_tokens=len(pieces), cached_tokens=4)
    events = reply.start(10)
    for delta in _deltas(pieces, finish):
        events += reply.delta(delta)
    events += reply.finish(usage)
    return events, reply.message(usage)


def _accumulate(events: list[dict]) -> dict:
    """The message a client builds from the events (the SDK's rules)."""
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    message = dict(events[0]["message"], content=[])
    inputs: dict[int, str] = {}
    for event in events[2:]:
        kind = event["type"]
        if kind == "content_block_start":
            assert event["index"] == len(message["content"])
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] in ("text_delta", "thinking_delta"):
                kind = delta["type"].removesuffix("_delta")
                block[kind] += delta[kind]
            else:
                inputs[event["index"]] = inputs.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and event["index"] in inputs:
            message["content"][event["index"]]["input"] = json.loads(inputs[event["index"]])
        elif kind == "message_delta":
            message.update(event["delta"], usage=event["usage"])
    assert events[-1] == {"type": "message_stop"}
    return message


def _auto(template: str | None = None) -> ReplyParsing:
    return ReplyParsing(ToolCalling(ToolFormat(template), ToolChoice("auto")))


def _same(streamed: dict, message: dict) -> None:
    strip = lambda m: [{k: v for k, v in b.items() if k != "id"} for b in m["content"]]  # noqa: E731
    assert strip(streamed) == strip(message)
    assert (streamed["stop_reason"], streamed["stop_sequence"]) == (message["stop_reason"], message["stop_sequence"])


def test_auto_tools_show_the_text_before_a_call_and_the_call_as_a_tool_use_block():
    call = ['{"name": "get_weather", "arguments": ', '{"city": "Paris"}}\n', "</tool_call>"]
    pieces = ["\n Let me ", "check. <to", "ol_call>\n", *call]
    events, message = _run(MessageReply("msg_1", "m", _auto(), []), pieces)
    texts = [e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and "text" in e["delta"]]
    assert "".join(texts) == "\n Let me check."  # the text before the call, less its trailing space
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    assert message["content"][1]["input"] == {"city": "Paris"} and message["content"][1]["id"].startswith("toolu_")
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {
        "input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 6,
    }
    _same(_accumulate(events), message)


def test_auto_tools_without_a_call_show_all_the_text():
    events, message = _run(MessageReply("msg_1", "m", _auto(), []), ["  Hello <", "b>", " there  "], "length")
    assert message["content"] == [{"type": "text", "text": "  Hello <b> there  "}]
    assert message["stop_reason"] == "max_tokens"
    _same(_accumulate(events), message)


def test_a_call_forced_by_name_streams_its_input():
    forced = ReplyParsing(ToolCalling(ToolFormat(None), ToolChoice("function", "get_weather")))
    events, message = _run(MessageReply("msg_1", "m", forced, []), ['{"ci', 'ty": "Pa', 'ris"}'])
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert parts == ['{"ci', 'ty": "Pa', 'ris"}']
    assert message["content"][0]["input"] == {"city": "Paris"} and message["stop_reason"] == "tool_use"
    _same(_accumulate(events), message)


def test_calls_forced_to_any_tool_arrive_whole_and_disable_parallel_keeps_one():
    forced = ReplyParsing(ToolCalling(ToolFormat(None), ToolChoice("required")))
    calls = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_weather", "parameters": {}}]'
    for parallel, count in ((True, 2), (False, 1)):
        events, message = _run(MessageReply("msg_1", "m", forced, [], parallel), [calls[:20], calls[20:]])
        assert [b["name"] for b in message["content"]] == ["get_weather"] * count
        assert message["content"][0]["input"] == {"city": "Rome"} and message["stop_reason"] == "tool_use"
        assert events[2]["type"] == "content_block_start"  # nothing was shown before the end
        _same(_accumulate(events), message)


def test_reasoning_is_a_thinking_block_before_the_text_and_the_call():
    parsing = ReplyParsing(_auto().tools, ReasoningParser("qwen3", opened=False))
    pieces = [
        "<thi",
        "nk>Paris is ",
        "in France.</th",
        "ink>\n\nLet me check.",
        "<tool_call>\n",
        '{"name": "get_',
        'weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ]
    events, message = _run(MessageReply("msg_1", "m", parsing, []), pieces)
    assert message["content"][:2] == [
        {"type": "thinking", "thinking": "Paris is in France.", "signature": ""},
        {"type": "text", "text": "Let me check."},
    ]
    assert message["content"][2]["input"] == {"city": "Paris"} and message["stop_reason"] == "tool_use"
    thinking = [e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert len(thinking) > 1 and "".join(thinking) == "Paris is in France."  # streamed as it came
    _same(_accumulate(events), message)
    not_streamed = MessageReply("msg_2", "m", parsing, [])
    for delta in _deltas(pieces, "stop"):
        not_streamed.delta(delta, streaming=False)
    not_streamed.finish(UsageCount())
    _same(not_streamed.message(UsageCount()), message)


def test_a_stop_sequence_is_cut_and_named():
    reply = MessageReply("msg_1", "m", None, ["END", "ND"])
    events, message = _run(reply, ["one ", "two", " END"])
    assert message["content"] == [{"type": "text", "text": "one two "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    _same(_accumulate(events), message)
    _, ended = _run(MessageReply("msg_2", "m", None, ["END"]), ["one"])  # EOS: an end of turn
    assert (ended["stop_reason"], ended["stop_sequence"]) == ("end_turn", None)


def test_an_empty_reply_has_no_blocks():
    events, message = _run(MessageReply("msg_1", "m", None, []), [""])
    assert message["content"] == [] and message["stop_reason"] == "end_turn"
    _same(_accumulate(events), message)


def test_blocks_become_chat_messages():
    body = {
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {}}],
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_a", "content": [{"type": "text", "text": "-3"}]},
                    {"type": "text", "text": "Thanks."},
                ],
            },
            {"role": "assistant", "content": "It is"},
        ],
    }
    conversation = parse_conversation(body)
    assert conversation.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_a", "content": "-3"},
        {"role": "user", "content": "Thanks."},
    ]
    assert conversation.prefill == "It is" and conversation.choice == ToolChoice("auto")
    assert conversation.tools[0]["function"]["parameters"] == WEATHER["input_schema"]


def test_request_settings():
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["a"], "top_k": 3}
    request = parse_messages_request(body)
    assert request.sampling == {"top_k": 3, "stop": ["a"], "include_stop_str_in_output": True}
    assert request.max_tokens == 5 and not request.stream
    for choice, expected in (
        ({"type": "any"}, ToolChoice("required")),
        ({"type": "tool", "name": "get_weather"}, ToolChoice("function", "get_weather")),
        ({"type": "none"}, ToolChoice("none")),
    ):
        assert parse_conversation({**body, "tools": [WEATHER], "tool_choice": choice}).choice == expected
    with pytest.raises(APIError, match="max_tokens"):
        parse_messages_request({"messages": body["messages"]})


def test_an_idle_stream_sends_pings(monkeypatch):
    monkeypatch.setattr(routes_messages, "PING_SECONDS", 0.01)

    async def handler(request: web.Request) -> web.StreamResponse:
        events = routes_messages.MessageEvents(request)
        await events.send([{"type": "message_start"}])
        await asyncio.sleep(0.2)  # a long prefill, a tool call held back
        await events.send([{"type": "message_stop"}])
        await events.close()
        return events.stream.response

    async def fetch() -> str:
        app = web.Application()
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            return await (await client.post("/")).text()

    names = [line.removeprefix("event: ") for line in asyncio.run(fetch()).splitlines() if line.startswith("event:")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert set(names[1:-1]) == {"ping"} and 5 <= len(names) - 2 <= 21  # every 0.01 s, not a busy loop
