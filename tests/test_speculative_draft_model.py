"""Draft-model speculative decoding (tiny random target and drafts of the same tokenizer, loaded from disk
like any model): greedy output token for token the same as without a draft (batched and alone, async or not,
with a draft of another shape), sampled output keeps its distribution (the verify rule against the exact
distribution with q given, and the engine with and without the draft), preemption and abort free the draft's
KV, warm-up compiles every draft and verify program, and a draft of another tokenizer is refused."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_models import write_drafts
from sampling_stats import assert_distributed_as, assert_same_distribution, seeded_first_tokens
from tokenizers import Tokenizer

from checkpoints.loaded import LoadedModel
from checkpoints.orbax_io import save_orbax
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams
from jaxserve.sampler import sampling_logits
from jaxserve.sampling_tensors import PenaltyCounts, RowSampling, SamplingTensors
from jaxserve.speculative.verify import verify

SMALL = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    block_size=8,
    num_blocks=200,
    decode_batch_buckets=(2, 8),
    block_table_buckets=(16,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(32, 64),
    prefill_seq_buckets=(4,),
)
K = 3


@pytest.fixture(scope="module")
def target():
    return build_tiny_random()


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    """Paths of two drafts: a noisy copy of the target, and a random model of one layer."""
    return write_drafts(target, tmp_path_factory.mktemp("drafts"))


def spec(path: str, **kw) -> dict:
    return {
        "model": path,
        "num_speculative_tokens": K,
        "disable_by_batch_size": 4,
        "adaptive_draft_length": False,
        **kw,
    }


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, warm_up=False, **SMALL)


@pytest.fixture(scope="module")
def speculative(target, drafts):
    return LLM(target, speculative_config=spec(drafts["noisy"]), **SMALL)  # warmed up: see the last test


def random_prompts(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 250, int(rng.integers(3, 90))).tolist()} for _ in range(n)]


GREEDY = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.2),
    SamplingParams(max_tokens=22, temperature=0.0, min_tokens=9, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[40, 41, 42, 43, 44, 45, 46, 47]),
    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
]


def outputs(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


# ----- the verify rule with the draft's distribution ------------------------------------------------

V = 40
_verify = jax.jit(verify, static_argnames="num_top_logprobs")


def test_rejection_sampling_against_q_keeps_the_target_distribution():
    """One draft per sequence drawn from q: the emitted first token is distributed as p (chi-square), the
    acceptance rate is sum min(p, q), and the bonus token after an accepted draft is distributed as p_1."""
    n = 6000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (2, V)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=15)
    rows = [RowSampling(params, seed=i, position=10 + j, penalty_row=-1) for i in range(n) for j in range(2)]
    t = SamplingTensors.build(rows, 2 * n, spare_row=1)
    one = SamplingTensors.build(rows[:2], 2, spare_row=1)
    p = np.asarray(jax.nn.softmax(sampling_logits(jnp.asarray(logits), one), axis=-1))
    q = np.asarray(jax.nn.softmax(rng.normal(0, 1.5, V) + np.log(p[0] + 0.02)))  # near p, not p
    draws = rng.choice(V, size=n, p=q / q.sum()).astype(np.int32)
    drafts = np.stack([draws, np.full(n, -1, np.int32)], axis=1).reshape(-1)
    history = np.stack([np.full(n, -1, np.int32), draws], axis=1).reshape(-1, 1)
    probs = np.zeros((2 * n, V), np.float32)
    probs[0::2] = q
    tiled = np.tile(logits, (n, 1))
    out, _ = _verify(tiled, t, PenaltyCounts.zeros(1, V), drafts, history, probs, num_top_logprobs=0)
    tokens = np.asarray(out.tokens)

    assert_distributed_as(tokens[:, 0], p[0])
    accepted = tokens[:, 0] == draws
    rate = np.minimum(p[0], q).sum()
    assert 0.2 < rate < 0.95 and abs(accepted.mean() - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    assert (tokens[~accepted, 1] == -1).all()
    assert_distributed_as(tokens[accepted, 1], p[1])


# ----- the engine -----------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_output_is_the_same_with_the_draft_batched_and_alone(
    plain, target, drafts, speculative, async_scheduling, assert_kv_all_free
):
    prompts = random_prompts(10, seed=1)
    params = [GREEDY[i % len(GREEDY)] for i in range(len(prompts) - 2)]
    params += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2  # they outlast the rest
    expected = outputs(plain, prompts, params)
    if async_scheduling:  # the module's engine has these settings (asynchronous scheduling is the default)
        assert speculative.engine.config.async_scheduling
        llm = speculative
    else:
        config = spec(drafts["noisy"])
        llm = LLM(target, warm_up=False, async_scheduling=async_scheduling, speculative_config=config, **SMALL)
    stats = llm.engine.stats  # counted from here: this test's requests only (the shared engine's counts grow)
    steps, drafted, accepted = stats.speculative_steps, stats.draft_tokens, stats.accepted_tokens
    assert outputs(llm, prompts, params) == expected  # 10 requests: above and below disable_by_batch_size
    drafted, accepted = stats.draft_tokens - drafted, stats.accepted_tokens - accepted
    assert stats.speculative_steps > steps and 0 < accepted < drafted
    for i in (0, 1, 2):
        assert outputs(llm, prompts[i : i + 1], params[i : i + 1]) == expected[i : i + 1]
    assert_kv_all_free(llm.engine)


def test_a_quantized_draft_of_another_shape_keeps_greedy_output_and_long_prompts_catch_up_in_chunks(
    plain, target, drafts, assert_kv_all_free
):
    """A one-layer random draft (its drafts mostly rejected) quantized on its own (`quantization` int8, the
    target unquantized); prompts longer than the largest token bucket (64) are prefilled into the draft's
    cache in chunks."""
    prompts = random_prompts(3, seed=2) + [{"prompt_token_ids": list(range(3, 103))}]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
    llm = LLM(target, warm_up=False, speculative_config=spec(drafts["small"], quantization="int8"), **SMALL)
    assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(llm.engine.proposer.device.params))
    assert outputs(llm, prompts, params) == outputs(plain, prompts, params)
    assert llm.engine.stats.draft_tokens > 0
    assert llm.engine.proposer.stats.calls > llm.engine.proposer.stats.steps  # catch-up chunks ran
    assert_kv_all_free(llm.engine)


def test_preemption_and_abort_free_the_drafts_kv(plain, target, drafts, assert_kv_all_free):
    """A pool too small for all four requests preempts some (their draft KV freed and rebuilt when they
    return); greedy output is unchanged. An aborted request's draft blocks go back too."""
    small_pool = {**SMALL, "num_blocks": 24}
    prompts = random_prompts(4, seed=3)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4
    llm = LLM(target, warm_up=False, speculative_config=spec(drafts["noisy"]), **small_pool)
    assert outputs(llm, prompts, params) == outputs(plain, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats.accepted_tokens > 0
    assert_kv_all_free(llm.engine)
    engine = llm.engine
    engine.add_request("a", prompts[0]["prompt_token_ids"], SamplingParams(max_tokens=60, ignore_eos=True))
    while not engine.proposer.kv.num_used:
        engine.step()
    engine.abort("a")
    assert_kv_all_free(engine)


def test_seeded_sampling_keeps_its_distribution(plain, speculative, assert_kv_all_free):
    """The first three tokens of 320 seeded requests at temperature 1 (top-k 3), with and without the
    draft: a two-sample chi-square test, and the draft's tokens were both accepted and rejected."""
    prompt = random_prompts(1, seed=4)[0]
    n = 320

    stats = speculative.engine.stats
    drafted, accepted = stats.draft_tokens, stats.accepted_tokens
    with_draft, without = (
        seeded_first_tokens(speculative, prompt, n, 3, 0),
        seeded_first_tokens(plain, prompt, n, 3, 10_000),
    )
    drafted, accepted = stats.draft_tokens - drafted, stats.accepted_tokens - accepted
    assert 0 < accepted < drafted
    assert_same_distribution(with_draft, without)
    assert_kv_all_free(speculative.engine)


def test_a_draft_with_another_tokenizer_is_refused(target, tmp_path):
    tokenizer = Tokenizer.from_str(target.tokenizer_bundle.tokenizer.to_str())
    tokenizer.add_tokens(["<extra>"])
    bundle = target.tokenizer_bundle.__class__(
        tokenizer=tokenizer,
        chat_template=target.tokenizer_bundle.chat_template,
        special_tokens=target.tokenizer_bundle.special_tokens,
        eos_token_ids=target.tokenizer_bundle.eos_token_ids,
    )
    save_orbax(LoadedModel(config=target.config, params=target.params, tokenizer_bundle=bundle), tmp_path / "other")
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        LLM(target, warm_up=False, speculative_config=spec(str(tmp_path / "other")), **SMALL)


def test_no_compilation_after_warm_up_with_a_draft_model(speculative):
    compiled = speculative.engine.num_compilations
    assert set(speculative.engine.proposer.programs.compiled) == {
        (2, 8, 16),
        (2, 32, 16),
        (2, 64, 16),
        (8, 32, 16),
        (8, 64, 16),
    }
    prompts = random_prompts(9, seed=5) + [{"prompt_token_ids": list(range(3, 120))}]
    params = [GREEDY[i % len(GREEDY)] for i in range(10)]
    params[3] = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.8, seed=2, presence_penalty=0.5)
    speculative.generate(prompts, params, use_tqdm=False)
    speculative.generate(prompts[:1], params[:1], use_tqdm=False)  # a batch of one
    assert speculative.engine.num_compilations == compiled
