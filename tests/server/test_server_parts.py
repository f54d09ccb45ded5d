"""The server's pure parts on their own: rate windows, the bounded queue, chat encoding with stored ids, pins."""

from __future__ import annotations

import pytest

from checkpoints.tiny_random import build_tiny_random
from jaxserve.tokenizer import Tokenizer
from server.admission import Admission
from server.auth import ApiKeys, owner_id, read_key_file
from server.errors import APIError
from server.json_body import MAX_DEPTH, JSONBodyError, nesting_depth, parse_json
from server.model_info import ModelInfo
from server.prompts import encode_chat, reply_token_ids
from server.rate_limit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_window_slides():
    clock = Clock()
    limiter = RateLimiter(rpm=2, clock=clock)
    limiter.admit("a")
    clock.now += 10
    limiter.admit("a")
    with pytest.raises(APIError) as refused:
        limiter.admit("a")
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "50"
    limiter.admit("b")  # other keys are not affected
    clock.now += 50.5  # the first request left the window
    limiter.admit("a")
    with pytest.raises(APIError):
        limiter.admit("a")


def test_generated_tokens_throttle_until_they_age_out():
    clock = Clock()
    limiter = RateLimiter(tpm=100, clock=clock)
    limiter.admit("a")
    limiter.charge_tokens("a", 60)
    clock.now += 30
    limiter.admit("a")
    limiter.charge_tokens("a", 50)
    with pytest.raises(APIError) as refused:
        limiter.admit("a")
    assert refused.value.headers["Retry-After"] == "30"  # when the first 60 tokens leave
    clock.now += 30.5
    limiter.admit("a")


def test_admission_counts_sequences_and_refuses_past_the_bound():
    admission = Admission(max_running_seqs=4, max_waiting_seqs=2)
    with admission.hold(4), admission.hold(2):
        with pytest.raises(APIError) as refused:
            with admission.hold(1):
                pass
        assert refused.value.status == 503
    assert admission.in_flight == 0
    with admission.hold(6):
        assert admission.in_flight == 6


def test_admission_admits_against_the_capacity_now_but_sizes_requests_against_the_most():
    capacity = [2]  # a router whose workers hold 4 running slots in all, 2 of them up
    admission = Admission(max_running_seqs=4, max_waiting_seqs=2, running_capacity=lambda: capacity[0])
    with admission.hold(4):  # 2 running + 2 waiting: full now
        assert admission.queue_depth() == 2
        with pytest.raises(APIError) as refused:
            with admission.hold(1):
                pass
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        capacity[0] = 4  # the other worker is back
        with admission.hold(2):
            assert admission.in_flight == 6
    capacity[0] = 0  # every worker down: only the waiting bound is admitted
    with pytest.raises(APIError) as refused:
        with admission.hold(3):
            pass
    assert refused.value.status == 503
    with pytest.raises(APIError) as too_large:  # larger than the whole cluster: 400, whatever is up
        with admission.hold(7):
            pass
    assert too_large.value.status == 400 and admission.in_flight == 0


def test_api_keys(tmp_path):
    keys = ApiKeys(["k1", "k2"])
    assert keys.authenticate("Bearer k2") == owner_id("k2") != owner_id("k1")
    for header in (None, "", "Bearer", "Bearer k3", "Token k1", "Bearer k1 k2"):
        with pytest.raises(APIError):
            keys.authenticate(header)
    assert ApiKeys([]).authenticate(None) == "anonymous"
    path = tmp_path / "keys"
    path.write_text("# team keys\nk1\n\n  k2  \n")
    assert read_key_file(path) == ["k1", "k2"]
    path.write_text("# nothing\n")
    with pytest.raises(ValueError):
        read_key_file(path)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(build_tiny_random().tokenizer_bundle)


def test_stored_reply_ids_are_used_as_generated_and_keep_the_prompt_a_prefix(tokenizer):
    info = ModelInfo("tiny", tokenizer, tokenizer.vocab_size, 512, 4, 8, 64, 0)
    reply = "Hello world"
    spelled = [tokenizer.encode(c)[0] for c in reply]  # how a model may have generated this text
    assert spelled != tokenizer.encode(reply) and tokenizer.decode(spelled) == reply
    turn = [{"role": "user", "content": "Hi"}]
    prompt = encode_chat(info, turn)
    assert prompt == tokenizer.encode(tokenizer.apply_chat_template(turn))  # no stored ids: the text as written
    history = [
        *turn,
        {"role": "assistant", "content": reply, "token_ids": spelled},
        {"role": "user", "content": "And now?"},
    ]
    assert encode_chat(info, history)[: len(prompt) + len(spelled)] == prompt + spelled
    without = [{k: v for k, v in m.items() if k != "token_ids"} for m in history]
    assert encode_chat(info, without) == tokenizer.encode(tokenizer.apply_chat_template(without))
    marker_in_text = [*history[:2], {"role": "user", "content": "\ue000 0 \ue000"}]  # markers in user text: fall back
    assert encode_chat(info, marker_in_text) == tokenizer.encode(
        tokenizer.apply_chat_template([{k: v for k, v in m.items() if k != "token_ids"} for m in marker_in_text])
    )


def test_reply_ids_are_stored_only_when_they_decode_to_the_stored_text(tokenizer):
    info = ModelInfo("tiny", tokenizer, tokenizer.vocab_size, 512, 4, 8, 64, 0)
    ids = tokenizer.encode("Hello world")
    assert reply_token_ids(info, [], ids, "Hello world", True) == ids
    assert reply_token_ids(info, [], ids, "Hello", True) is None  # a stop string cut the text
    assert reply_token_ids(info, ids[:1], ids[1:], "Hello world", True) == ids  # continued


def test_json_nesting_is_measured_outside_strings():
    assert nesting_depth(b'{"a": "[[[[{{", "b": [1, [2]]}') == 3
    assert nesting_depth(b'{"a": "x\\"[[[[\\\\", "b": "]]]"}') == 1  # escaped quotes and backslashes
    assert nesting_depth(b"1") == 0
    assert parse_json(b'{"n": 12345678901234567890, "x": [0.5, -1e10, "\\u00e9"]}') == {
        "n": 12345678901234567890,
        "x": [0.5, -1e10, "\u00e9"],
    }
    for bad in (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), b"1" * 41, b"-Infinity", b'["\\udc80"]', b"\xff"):
        with pytest.raises(JSONBodyError):
            parse_json(bad)
