"""The router's parts without processes: the approximate prefix tree, the placement policy with
the router's defaults, the worker wire format, and bad command lines."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess

import pytest
from child_process import jaxserve

from jaxserve.engine_client import EngineDeadError, EngineInfo
from jaxserve.kv.content_keys import ChainKeys
from jaxserve.placement import PlacementPolicy, choose_target
from jaxserve.placement.kv_index import KVIndex
from jaxserve.placement.prefix_tree import ApproxPrefixTree
from jaxserve.placement.sent_prefixes import SentPrefixes
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import GuidedDecoding
from server.cluster.router.remote_engine import RemoteEngine
from server.cluster.router.sequence import worker_params
from server.cluster.router.worker_client import WorkerClient, WorkerInfo
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import params_from_json, params_to_json


def test_prefix_tree_matches_splits_and_evicts_least_recently_used():
    tree = ApproxPrefixTree()
    tree.insert([1, 2, 3, 4, 5])
    tree.insert([1, 2, 3, 9])
    assert tree.num_tokens == 6  # [1 2 3] shared, then [4 5] and [9]
    assert tree.match([1, 2, 3, 4, 5, 6]) == 5
    assert tree.match([1, 2, 3, 9, 9]) == 4
    assert tree.match([1, 2, 7]) == 2
    assert tree.match([7, 1]) == 0
    tree.insert([1, 2])  # inside an edge: nothing new
    assert tree.num_tokens == 6
    small = ApproxPrefixTree(max_tokens=25)
    small.insert(list(range(10)))
    small.insert(list(range(100, 110)))
    small.match(list(range(10)))  # used: the other one is older
    small.insert(list(range(200, 210)))
    assert small.num_tokens == 20
    assert small.match(list(range(10))) == 10 and small.match(list(range(200, 210))) == 10
    assert small.match(list(range(100, 110))) == 0
    small.clear()
    assert small.num_tokens == 0 and small.match(list(range(10))) == 0
    with pytest.raises(ValueError):
        ApproxPrefixTree(max_tokens=0)


ROUTER_POLICY = PlacementPolicy()


def test_placement_policy_defaults_are_sglangs():
    assert (ROUTER_POLICY.match_fraction, ROUTER_POLICY.balance_abs, ROUTER_POLICY.balance_rel) == (0.3, 64, 1.5)
    # 30 of 100 tokens cached on the busier worker: the prefix wins while loads are close...
    assert choose_target([30, 0], [10, 0], 100, ROUTER_POLICY) == 0
    assert choose_target([29, 0], [10, 0], 100, ROUTER_POLICY) == 1  # ...but not under 30%
    # Imbalance beyond both thresholds (more than 64 apart and 1.5x) overrides the prefix.
    assert choose_target([100, 0], [65, 0], 100, ROUTER_POLICY) == 1
    assert choose_target([100, 0], [64, 0], 100, ROUTER_POLICY) == 0
    assert choose_target([100, 0], [200, 150], 100, ROUTER_POLICY) == 0  # 50 apart: not imbalanced


def test_lora_requests_prefer_workers_holding_their_adapter_and_match_only_its_prefixes():
    # The policy: among replicas holding the adapter unless loads are imbalanced.
    assert choose_target([0, 0], [3, 0], 40, ROUTER_POLICY, resident=[True, False]) == 0
    assert choose_target([0, 0], [3, 0], 40, ROUTER_POLICY, resident=[False, False]) == 1
    assert choose_target([0, 0], [100, 0], 40, ROUTER_POLICY, resident=[True, False]) == 1
    assert choose_target([0, 40, 40], [0, 0, 1], 40, ROUTER_POLICY, resident=[False, True, True]) == 1
    sent = SentPrefixes()
    assert sent.key([5, 6], None) == [5, 6] and sent.key([5, 6], "sql") == [-1, 5, 6]
    assert sent.key([5, 6], "chat") == [-2, 5, 6]
    sent.forget_adapter("sql")  # loaded again: maybe other weights, so a new key
    assert sent.key([5, 6], "sql") == [-3, 5, 6]
    # The router's picture of its workers, fed as requests are sent (no process behind them).
    remote = RemoteEngine(
        [WorkerClient("127.0.0.1:1"), WorkerClient("127.0.0.1:2")], dataclasses.replace(ROUTER_POLICY, lora_slots=1)
    )
    a, b = remote.workers
    a.up = b.up = True
    prompt = list(range(40))
    pool = remote.pool
    assert pool.pick(prompt, lora="sql") is a  # nothing known: least loaded, lower index
    a.sent.note(prompt, "sql", 1)
    a.in_flight = 3
    assert pool.pick(prompt, lora="sql") is a  # holds sql and its prefix, though busier
    assert pool.pick(list(range(100, 140)), lora="sql") is a  # holds sql: no LoRA slot to wait for
    assert pool.pick(prompt, lora="chat") is b  # sql's prefix is not chat's KV
    assert pool.pick(prompt) is b  # nor the base model's
    a.sent.note(prompt, "chat", 1)  # one LoRA slot: chat took sql's place
    assert list(a.sent.recent_adapters) == ["chat"]
    assert pool.pick(list(range(100, 140)), lora="sql") is b
    # Sessions stick to their worker while it is a candidate, then move.
    assert pool.place(list(range(200, 240)), "s") is b
    assert pool.place(prompt, "s") is b and pool.placement.session_target("s") is b
    # An adapter loaded through the router goes only to workers that have it loaded.
    pool.adapters["law"] = "/adapters/law"
    a.loaded_adapters.add("law")
    assert pool.pick(prompt, lora="law") is a
    assert pool.place(prompt, "s", lora="law") is a  # its worker cannot serve it: placed afresh
    a.up = False
    with pytest.raises(EngineDeadError, match="no worker is available"):
        pool.pick(prompt, lora="law")


def test_sampling_params_cross_the_wire_and_bad_json_is_a_clear_error():
    params = SamplingParams(
        n=3, max_tokens=7, temperature=0.5, stop=["x"], logit_bias={5: -100.0}, seed=9, logprobs=2, min_tokens=1
    )
    sent = worker_params(params, seed=11)
    assert (sent.n, sent.seed, sent.stop) == (1, 11, [])
    assert params_from_json(params_to_json(sent)) == sent
    guided = SamplingParams(
        guided=GuidedDecoding("json", {"type": "object", "properties": {"a": {"type": "integer"}}}), prompt_logprobs=1
    )
    assert params_from_json(params_to_json(guided)) == guided
    for bad, message in [
        ('{"guided": {"kind": "regex"}}', "kind and value"),
        ("{", "does not parse"),
        ("[1]", "JSON object"),
        ('{"nope": 1}', "unknown sampling"),
        ('{"logit_bias": {"a": 1}}', "token ids"),
        ('{"max_tokens": -1}', "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=message):
            params_from_json(bad)


def test_workers_serving_other_models_cannot_join():
    info = WorkerInfo("m", 300, 256, 4, 8, "{}", None, (("eos_token", "</s>"),), (2,), 64, "")
    assert info.mismatch(dataclasses.replace(info, max_num_seqs=8)) is None  # capacity may differ
    assert "block size" in info.mismatch(dataclasses.replace(info, block_size=16))
    assert "hidden size" in info.mismatch(dataclasses.replace(info, hidden_size=32))
    assert "tokenizer json" in info.mismatch(dataclasses.replace(info, tokenizer_json="[]"))
    encoder = dataclasses.replace(info, encoder_config_json='{"architecture": "bert"}')
    assert "encoder config json" in info.mismatch(encoder)  # a decoder and an encoder never mix


@pytest.mark.parametrize(
    "args, message",
    [
        (["router", "--port", "1", "--worker", "nohostport"], "HOST:PORT"),
        (["router", "--port", "1", "--worker", "h:1", "--cache-threshold", "2"], "--cache-threshold"),
        (["router", "--port", "1"], "give --worker or --decode-worker"),
        (
            ["router", "--port", "1", "--worker", "h:1", "--prefill-worker", "h:2"],
            "--prefill-worker needs --decode-worker",
        ),
        (
            ["worker", "--model", "tiny-random", "--port", "1", "--role", "prefill", "--data-parallel-size", "2"],
            "one engine replica",
        ),
        (
            ["worker", "--model", "tiny-random", "--port", "1", "--role", "decode", "--kv-lease-timeout", "0"],
            "--kv-lease-timeout must be positive",
        ),
    ],
)
def test_bad_command_lines_get_clear_errors(args, message):
    result = subprocess.run(jaxserve(*args), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr + result.stdout, result.stderr


def test_a_burst_placed_before_any_worker_call_starts_is_spread_by_load():
    """Requests that arrive together are placed before the first one's worker call starts: each
    counts in its worker's load from placement, so the burst goes to both workers, and the loads
    are back to zero once the requests end (here: their calls fail, nothing listens)."""

    async def burst() -> tuple[list[int], list[int]]:
        remote = RemoteEngine([WorkerClient("127.0.0.1:1"), WorkerClient("127.0.0.1:2")], ROUTER_POLICY)
        remote.info = EngineInfo("m", None, 300, 64, 4, 8, 16)
        for worker in remote.workers:
            worker.up = True
        params = SamplingParams(max_tokens=2)
        streams = [remote.generate(f"r{i}", [3 + i, 4, 5], params) for i in range(4)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0)  # each generator placed its request; no worker call has run yet
        placed = [remote._requests[f"r{i}"][0].worker for i in range(4)]
        loads = [w.in_flight for w in remote.workers]
        for first in firsts:
            first.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        return [remote.workers.index(w) for w in placed], loads + [w.in_flight for w in remote.workers]

    placed, loads = asyncio.run(burst())
    assert placed == [0, 1, 0, 1]
    assert loads == [2, 2, 0, 0]


def test_the_routers_running_capacity_is_the_sum_of_the_workers_that_are_up():
    """What the router's server admits against (`Admission`): each worker's own `max_num_seqs`, as its
    `Info` reported it, for the workers up now; a worker marked down takes its slots with it."""
    remote = RemoteEngine([WorkerClient("127.0.0.1:1"), WorkerClient("127.0.0.1:2")], ROUTER_POLICY)
    info = WorkerInfo("m", 300, 256, 4, 8, "{}", None, (("eos_token", "</s>"),), (2,), 64, "")
    assert remote.running_capacity() == 0  # nothing checked yet
    for worker, seqs in zip(remote.workers, (4, 6)):
        worker.up, worker.info = True, dataclasses.replace(info, max_num_seqs=seqs)
    assert remote.running_capacity() == 10
    remote.workers[1].mark_down("health check failed")
    assert remote.running_capacity() == 4


def test_a_lora_prompts_blocks_in_the_kv_events_match_once_the_worker_listed_the_adapters_digest():
    """A worker keys a LoRA request's blocks from its seed salted by the adapter's weights digest
    (`ChainKeys.salted`, as its scheduler does); the router matches them with the digest the worker
    lists for the adapter's name (`LoraAdaptersResponse.digests`), and not for the base model."""
    seed, bs, digest = bytes(range(16)), 4, b"adapter weights digest"
    prompt = list(range(3, 23))  # 5 blocks of 4
    worker = WorkerClient("127.0.0.1:1")
    worker.kv_index = KVIndex(seed, bs, ChainKeys(seed, bs).salted(digest).keys(prompt, 4))
    assert worker.prefix_match_length(prompt, "sql") == 0  # its digest not listed yet: not matched
    assert worker.prefix_match_length(prompt) == 0  # the base model's keys differ
    worker.note_adapters(pb.LoraAdaptersResponse(adapters={"sql": "/a"}, digests={"sql": digest}))
    assert worker.prefix_match_length(prompt, "sql") == 16
    assert worker.prefix_match_length([*prompt[:9], 0, 0, 0], "sql") == 8
    worker.note_adapters(pb.LoraAdaptersResponse(adapters={"sql": "/b"}, digests={"sql": b"other weights"}))
    assert worker.prefix_match_length(prompt, "sql") == 0  # the name now runs other weights
