"""The official `openai` client against the server: chat and completions, stream and not."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import KEY_A, MODEL_NAME, send

from server.state import STATE

CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. Hello world!"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)


def stream_chat(client, **kw):
    """(text per choice, finish reasons, usage chunk) of a streamed chat completion."""
    texts, finish, usage = {}, {}, None
    chunks = client.chat.completions.create(model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, finish, usage


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_chat_non_stream_and_stream_agree_for_a_seed(client):
    kw = dict(messages=CHAT, max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    full = client.chat.completions.create(model=MODEL_NAME, **kw)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = full.usage
    assert usage.completion_tokens >= 1 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    texts, finish, stream_usage = stream_chat(client, **kw)
    assert texts == {0: choice.message.content}
    assert finish == {0: choice.finish_reason}
    assert (stream_usage.prompt_tokens, stream_usage.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def test_seed_reproduces_and_other_seeds_differ(client):
    def run(seed):
        out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=1.0, seed=seed)
        return out.choices[0].message.content

    first = run(7)
    assert run(7) == first
    assert len({run(s) for s in (8, 9, 10)} | {first}) > 1


def test_completions_stream_equals_non_stream_with_n_2(client):
    kw = dict(prompt="def add(a, b):", max_tokens=12, temperature=0.8, seed=99, n=2)
    full = client.completions.create(model=MODEL_NAME, **kw)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].text != full.choices[1].text  # each choice has its own random stream
    texts, finish = {}, {}
    usage = None
    for chunk in client.completions.create(model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens  # the prompt counts once, not per choice


def test_chat_n_2_and_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=5, logprobs=True, top_logprobs=3
    )
    assert len(out.choices) == 2
    total = 0
    for choice in out.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 6
        total += len(content)
        for entry in content:
            assert entry.logprob <= 0.0
            assert len(entry.top_logprobs) == 3
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
            assert entry.bytes == list(entry.token.encode())
    assert out.usage.completion_tokens == total


def test_greedy_logprobs_pick_the_top_token(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value == pytest.approx(max(top.values()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_logit_bias_forces_and_bans_tokens(client, server):
    text_of = server.app[STATE].info.token_text
    kw = dict(
        model=MODEL_NAME, prompt=[40, 41, 42], max_tokens=6, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
    )
    forced = client.completions.create(logit_bias={"90": 100}, **kw).choices[0].logprobs
    assert forced.tokens == [text_of(90)] * 6
    banned = client.completions.create(logit_bias={"90": -100, "91": 100}, **kw).choices[0].logprobs
    assert banned.tokens == [text_of(91)] * 6
    # Log-probabilities stay the model's: the forced token's is its raw one, below the top.
    assert forced.token_logprobs[0] < max(forced.top_logprobs[0].values())


def test_min_tokens_holds_back_eos(client, server):
    eos = server.app[STATE].info.tokenizer.eos_token_ids[0]
    kw = dict(model=MODEL_NAME, prompt=[40, 41, 42], max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    eager = client.completions.create(**kw)  # EOS is all but forced
    assert (eager.choices[0].finish_reason, eager.usage.completion_tokens) == ("stop", 1)
    held = client.completions.create(extra_body={"min_tokens": 3}, **kw)
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 4)  # 3 tokens, then EOS
    assert held.choices[0].text  # the three tokens before EOS


def test_echo_puts_each_prompt_before_its_completions(client, server):
    kw = dict(model=MODEL_NAME, max_tokens=6, temperature=0)
    texts = ["The quick brown fox", "Hello"]
    plain = client.completions.create(prompt=texts, n=2, **kw)
    echoed = client.completions.create(prompt=texts, n=2, echo=True, **kw)
    assert [c.text for c in echoed.choices] == [texts[i // 2] + c.text for i, c in enumerate(plain.choices)]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=texts[0], echo=True, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: echoed.choices[0].text}
    ids = [40, 41, 42]  # token ids are echoed as their text
    by_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    prompt_text = server.app[STATE].info.tokenizer.decode(ids, skip_special_tokens=False)
    assert by_ids == prompt_text + client.completions.create(prompt=ids, **kw).choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, server):
    """lm-eval-harness's loglikelihood request: echo + logprobs + max_tokens 1; the prompt's
    tokens come first in the logprobs, the first one with null values."""
    ids = [40, 41, 42, 43, 44, 45]
    kw = dict(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=2)
    echoed = client.completions.create(echo=True, **kw).choices[0]
    scored = client.completions.create(extra_body={"prompt_logprobs": 2}, **kw).choices[0]
    info = server.app[STATE].info
    lp = echoed.logprobs
    assert lp.tokens == [info.token_text(i) for i in ids] + scored.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    vllm = scored.model_extra["prompt_logprobs"]  # vLLM's field: None, then {id: {logprob, rank, decoded_token}}
    assert vllm[0] is None and len(vllm) == len(ids)
    assert lp.token_logprobs[1 : len(ids)] == [vllm[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
    assert all(v <= 0 for v in lp.token_logprobs[1 : len(ids)])
    for p in range(1, len(ids)):
        best = max(vllm[p].values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and len(lp.top_logprobs[p]) <= 2
        assert max(lp.top_logprobs[p].values()) == best["logprob"]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert lp.token_logprobs[len(ids) :] == scored.logprobs.token_logprobs  # then the completion's
    streamed = [c for chunk in client.completions.create(echo=True, stream=True, **kw) for c in chunk.choices]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert (tokens, values) == (lp.tokens, lp.token_logprobs)


def test_chat_prompt_logprobs_are_returned_for_the_rendered_prompt(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    scores = reply.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == reply.usage.prompt_tokens
    assert all(len(entry) >= 1 and all(e["logprob"] <= 0 for e in entry.values()) for entry in scores[1:])


def test_stop_string_cuts_the_text_and_does_not_leak(client):
    kw = dict(messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(model=MODEL_NAME, **kw).choices[0].message.content
    stop = next(c for c in text[2:] if c.isascii() and c.isalnum())
    expected = text[: text.index(stop)]
    out = client.chat.completions.create(model=MODEL_NAME, stop=[stop], **kw)
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop"
    texts, finish, _ = stream_chat(client, stop=stop, **kw)
    assert texts == {0: expected} and finish == {0: "stop"}
    kw["extra_body"]["include_stop_str_in_output"] = True  # vLLM's option: keep the stop string
    kept = client.chat.completions.create(model=MODEL_NAME, stop=[stop], **kw).choices[0].message.content
    assert kept == expected + stop
    assert stream_chat(client, stop=stop, **kw)[0] == {0: expected + stop}


def test_completions_accept_token_ids_and_prompt_lists(client):
    ids = [40, 41, 42, 43, 44]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    many = client.completions.create(model=MODEL_NAME, prompt=[ids, [50, 51]], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == by_ids.choices[0].text  # greedy: same prompt, same text
    assert many.usage.prompt_tokens == len(ids) + 2


def test_raw_stream_shape_ends_with_done(server):
    reply = send(
        server,
        "POST",
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "ignore_eos": True, "stream": True},
    )
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = reply.text.split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert all("usage" not in c for c in chunks)  # OpenAI sends none without stream_options.include_usage
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
