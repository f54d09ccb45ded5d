"""The data-parallel engine: load spreading, cache-aware routing and sticky sessions.

The policy is checked as a pure function; the engine itself with two real tiny replicas in
this process (both on the one default device: routing does not depend on where replicas run;
the multi-device layouts are covered by test_tensor_data_parallel.py).
"""

from __future__ import annotations

import pytest
from mesh_cases import TINY_ENGINE, generate_greedy

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine, make_engine
from jaxserve.engine import LLMEngine
from jaxserve.placement import PlacementPolicy, choose_target
from jaxserve.sampling_params import SamplingParams

POLICY = PlacementPolicy(match_fraction=0.5, balance_abs=4, balance_rel=1.5)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def test_least_loaded_replica_wins_without_a_cache_hit():
    assert choose_target([0, 0, 0], [3, 1, 2], 40, POLICY) == 1
    assert choose_target([0, 0], [1, 1], 40, POLICY) == 0  # ties: lower index


def test_longest_prefix_match_wins_over_load():
    assert choose_target([0, 32, 16], [0, 3, 0], 40, POLICY) == 1
    assert choose_target([32, 32], [2, 1], 40, POLICY) == 1  # equal matches: less loaded


def test_short_matches_and_imbalance_fall_back_to_load():
    assert choose_target([0, 8], [0, 1], 40, POLICY) == 0  # 8 of 40 tokens: below half
    assert choose_target([0, 32], [0, 9], 40, POLICY) == 0  # holder is overloaded


@pytest.fixture(scope="module")
def dp():
    model = build_tiny_random(num_heads=8, num_kv_heads=4)
    config = EngineConfig(**TINY_ENGINE)
    dp = DataParallelEngine([LLMEngine(model, config), LLMEngine(model, config)], POLICY)
    yield dp
    dp.close()


def test_requests_spread_requests_over_replicas(dp):
    prompts = [[10 + i] * 9 for i in range(4)]
    for i, p in enumerate(prompts):
        dp.add_request(f"spread{i}", p, ONE_TOKEN)
    assert dp.loads() == [2, 2]
    while dp.has_unfinished_requests():
        dp.step()
    assert dp.loads() == [0, 0]
    assert not dp.is_active("spread0")


def test_shared_prefix_goes_to_the_replica_holding_it(dp, assert_kv_all_free):
    system = list(range(3, 43))  # 40 tokens = 5 full blocks of 8
    dp.add_request("busy", [200] * 9, ONE_TOKEN)  # replica 0 (tie), so the next goes to 1
    generate_greedy(dp, [system + [50, 51]], max_tokens=2, prefix="holder")
    holder = [e.prefix_match_length(system + [60]) for e in dp.replicas]
    assert holder == [0, 40]
    # Both idle now: load alone would pick replica 0, the cached prefix picks replica 1.
    assert dp.loads() == [0, 0]
    assert dp.route(system + [60, 61, 62]) == 1
    group = dp.add_request("follower", system + [60, 61, 62], ONE_TOKEN)
    assert dp.loads() == [0, 1]
    while dp.has_unfinished_requests():
        dp.step()
    assert group[0].num_cached_prompt_tokens == 40
    for engine in dp.replicas:
        assert_kv_all_free(engine)


def replica_running(dp, request_id):
    return [e.is_active(request_id) for e in dp.replicas].index(True)


def test_sessions_stick_to_their_replica(dp):
    dp.add_request("s1-turn1", [77] * 12, ONE_TOKEN, session_id="s1")
    first = replica_running(dp, "s1-turn1")
    other = 1 - first
    dp.add_request("filler", [88] * 12, ONE_TOKEN)  # load: both replicas now hold one
    dp.add_request("s1-turn2", [99] * 12, ONE_TOKEN, session_id="s1")  # unrelated prompt
    assert replica_running(dp, "s1-turn2") == first and replica_running(dp, "filler") == other
    while dp.has_unfinished_requests():
        dp.step()
    dp.end_session("s1")
    assert dp.route([99] * 12, session_id="s1") == 0  # routed afresh: idle tie


def test_abort_and_duplicate_ids(dp):
    dp.add_request("dup", [5] * 10, ONE_TOKEN)
    with pytest.raises(ValueError, match="duplicate"):
        dp.add_request("dup", [6] * 10, ONE_TOKEN)
    deltas = dp.abort("dup")
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert not dp.has_unfinished_requests() and dp.abort("dup") == []


def test_make_engine_builds_a_data_parallel_engine_only_for_dp():
    model = build_tiny_random()
    assert isinstance(make_engine(model, EngineConfig(**TINY_ENGINE)), LLMEngine)
    with pytest.raises(ValueError, match="devices requested"):  # one device here
        make_engine(model, EngineConfig(data_parallel_size=2, **TINY_ENGINE))


def test_a_lone_engine_refuses_data_parallel_settings():
    with pytest.raises(ValueError, match="data_parallel.make_engine"):
        LLMEngine(build_tiny_random(), EngineConfig(data_parallel_size=2, **TINY_ENGINE))
