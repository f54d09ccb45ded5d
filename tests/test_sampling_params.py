import pytest

from jaxserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOTAL_CHARS,
    MIN_TEMPERATURE,
    SamplingParams,
)


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p) == (1, 16, 1.0, 1.0)
    assert (p.top_k, p.min_p) == (0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert not p.ignore_eos and p.skip_special_tokens and p.priority == 0
    assert not p.is_greedy and not p.has_penalties


def test_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=0, stop_token_ids=(7, 8))
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.is_greedy and isinstance(p.temperature, float)
    assert p.stop_token_ids == [7, 8]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={5: -100, 6: 1}).logit_bias == {5: -100.0, 6: 1.0}
    stops = ["a", "b"]
    assert SamplingParams(stop=stops).stop is not stops  # later edits do not leak in


def test_accepts_edge_values() -> None:
    p = SamplingParams(
        top_p=1e-6,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1e-3,
        logprobs=MAX_LOGPROBS,
        seed=2**64 - 1,
        top_k=2**31 - 1,
        max_tokens=1,
    )
    assert p.has_penalties
    assert SamplingParams(logprobs=0).logprobs == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"priority": "high"}, "priority"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # above max_tokens (16)
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
        # What the engine's int32 / float32 rows can hold.
        ({"n": 2**31}, "n"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"top_k": 10**310}, "top_k"),
        ({"priority": -(2**31) - 1}, "priority"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"logit_bias": {2**31: 1}}, "logit_bias"),
        ({"temperature": 1e39}, "temperature"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"repetition_penalty": 1e4}, "repetition_penalty"),
        # What one request may cost every other one's step.
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop": ["x" * MAX_STOP_STRING_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"stop": ["ok", "\ud800"]}, "stop"),
    ],
)
def test_rejects_absurd_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_longest_allowed_stop_strings_are_accepted() -> None:
    per = MAX_STOP_TOTAL_CHARS // MAX_STOP_STRINGS
    assert len(SamplingParams(stop=["y" * per] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    assert SamplingParams(stop=["z" * MAX_STOP_STRING_CHARS]).stop[0] == "z" * MAX_STOP_STRING_CHARS


def test_tiny_temperature_is_raised_to_the_float32_safe_floor() -> None:
    assert SamplingParams(temperature=1e-30).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    "kwargs,field", [({"stop_token_ids": [0, 100]}, "stop_token_ids"), ({"logit_bias": {100: 1.0}}, "logit_bias")]
)
def test_token_ids_are_checked_against_the_vocabulary(kwargs: dict, field: str) -> None:
    params = SamplingParams(**kwargs)
    params.check_vocabulary(101)
    with pytest.raises(ValueError, match=field):
        params.check_vocabulary(100)
