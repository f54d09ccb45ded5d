import pytest

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams


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
        top_p=1e-6, min_p=1.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3,
        logprobs=MAX_LOGPROBS, seed=2**70, top_k=1, max_tokens=1,
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
    ],
)
def test_rejects_absurd_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
