"""Prefill/decode disaggregation over real worker processes (tiny random model, loopback gRPC).

`jaxserve router --prefill-worker P --decode-worker D` against `jaxserve router --worker C`
(colocated, the same engine settings): the same text, tokens, logprobs and usage on a set of
prompts (greedy, seeded sampling with n = 2, stop strings, min_tokens, a penalty that is not
split); transferred and skipped blocks counted in /metrics; a lease nobody pulls freed at its
timeout; a puller or a client that goes away mid-transfer leaking nothing; an expired lease
leaving the decode worker to recompute the same output; a decode worker dead before its half
getting the half retried on another, and one dead mid-stream having it resumed on another; blocks moved
device to device (`--kv-transport device`,
jax.experimental.transfer between the CPU processes) giving the same output, and a decode worker
with a transfer server pulling bytes from a prefill worker without one. After each test the
workers' pools are all free, with no lease and no hold left. One module-scoped cluster of three
workers (the retry test adds one), and a pair with device transfer for its tests.
"""

from __future__ import annotations

import random
import re
import time

import grpc
import jax
import pytest
from child_process import SMALL_ENGINE, free_port
from router_cluster import Endpoint, Stream, start_router, start_worker
from server_harness import KEY_A, MODEL_NAME, send

from jaxserve.sampling_params import SamplingParams
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import params_to_json, snapshot_from_json
from server.cluster.worker.worker_pb2_grpc import WorkerStub

BLOCK = 8  # SMALL_ENGINE's block size
LEASE_TIMEOUT = 3.0


def _prompt(seed: int, n: int) -> list[int]:
    """Token ids no other prompt of this module starts with."""
    return random.Random(seed).choices(range(3, 299), k=n)


@pytest.fixture(scope="module")
def cluster(_compilation_cache):
    cache_dir = jax.config.jax_compilation_cache_dir
    ports = {"both": free_port(), "prefill": free_port(), "decode": free_port()}
    flags = {
        "both": [],
        "prefill": ["--role", "prefill", "--kv-lease-timeout", str(LEASE_TIMEOUT)],
        "decode": ["--role", "decode"],
    }
    procs = {"both": start_worker(ports["both"], SMALL_ENGINE, cache_dir)}
    procs["both"].wait_for("worker listening", timeout=900)  # the others find its programs in the cache
    for role in ("prefill", "decode"):
        procs[role] = start_worker(ports[role], [*SMALL_ENGINE, *flags[role]], cache_dir)
    for role in ("prefill", "decode"):
        procs[role].wait_for("worker listening", timeout=900)
    split_router, split = start_router(
        [],
        "--prefill-worker",
        f"127.0.0.1:{ports['prefill']}",
        "--decode-worker",
        f"127.0.0.1:{ports['decode']}",
        "--api-key",
        KEY_A,
    )
    colo_router, colo = start_router([ports["both"]], "--api-key", KEY_A)
    split_router.wait_for("Running on", timeout=120)
    colo_router.wait_for("Running on", timeout=120)
    yield dict(ports=ports, split=split, colo=colo)
    routers = [split_router, colo_router]
    for proc in [*routers, *procs.values()]:
        proc.terminate()
    for proc in [*routers, *procs.values()]:
        proc.finish(60)
    output = "\n".join(p.output for p in [*routers, *procs.values()])
    assert "Traceback" not in output, output


def _stub(port: int) -> tuple[grpc.Channel, WorkerStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, WorkerStub(channel)


def _load(port: int) -> pb.LoadResponse:
    channel, stub = _stub(port)
    with channel:
        return stub.Load(pb.LoadRequest(), timeout=30)


def _all_free(port: int, timeout: float = 30.0) -> None:
    """Nothing runs on the worker and every block is free or reclaimable: no request, pin, lease or hold."""
    deadline = time.monotonic() + timeout
    while True:
        reply = _load(port)
        snap = snapshot_from_json(reply.snapshot_json)
        free = (
            not snap.has_unfinished
            and snap.kv_requests == 0
            and snap.kv.used == 0
            and snap.kv.pinned == 0
            and snap.kv.free + snap.kv.cached_idle == snap.kv.num_blocks
            and reply.kv_leases == 0
        )
        if free:
            return
        assert time.monotonic() < deadline, (snap, reply.kv_leases)
        time.sleep(0.05)


def _both_free(cluster) -> None:
    for role in ("prefill", "decode"):
        _all_free(cluster["ports"][role])


def _transfers(router: Endpoint) -> dict[str, float]:
    text = send(router, "GET", "/metrics", key=None).text
    out = {}
    for name, label in (
        ("transfers_total", None),
        ("device_transfers_total", None),
        ("transfer_blocks_total", "pulled"),
        ("transfer_blocks_total", "skipped"),
        ("transfer_bytes_total", None),
        ("transfer_failures_total", None),
        ("transfer_duration_seconds_count", None),
    ):
        labels = f'{{kind="{label}"}}' if label else ""
        out[label or name] = float(re.search(rf"^jaxserve_kv_{name}{re.escape(labels)} (\S+)$", text, re.M).group(1))
    return out


def _completion(prompt, max_tokens: int, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def _close(got, want, path: str = "") -> None:
    """Equal, but for floats within 1e-4: the decode worker computes the prompt's partial block
    and the first token in a prefill step, where one worker ran them as decode steps."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), path
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            _close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _same_output(cluster, path: str, body: dict, split_router: str = "split") -> dict:
    colo = send(cluster["colo"], "POST", path, body)
    split = send(cluster[split_router], "POST", path, body)
    assert colo.status == split.status == 200, (colo.text, split.text)
    _close(split.json["choices"], colo.json["choices"], str(body))
    usage = lambda r: {k: r["usage"][k] for k in ("prompt_tokens", "completion_tokens")}  # noqa: E731
    assert usage(split.json) == usage(colo.json), body
    return colo.json


def _compilations(cluster) -> list[int]:
    return [
        snapshot_from_json(_load(cluster["ports"][r]).snapshot_json).num_compilations for r in ("prefill", "decode")
    ]


def test_split_serving_gives_the_colocated_output(cluster):
    before = _transfers(cluster["split"])
    compiled = _compilations(cluster)
    cases = [
        ("/v1/completions", _completion(_prompt(1, 61), 12, ignore_eos=True, logprobs=2)),  # 7 full blocks
        ("/v1/completions", _completion(_prompt(2, 5), 6, ignore_eos=True)),  # no full block: nothing to move
        ("/v1/completions", _completion("Hello there", 10)),
        ("/v1/completions", _completion(_prompt(3, 24), 10, temperature=0.8, seed=7, n=2, ignore_eos=True)),
        ("/v1/completions", _completion(_prompt(4, 30), 8, min_tokens=3)),
        ("/v1/completions", _completion(_prompt(5, 20), 8, presence_penalty=0.5, ignore_eos=True)),  # not split
        (
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Hi, who are you?"}],
                "max_tokens": 10,
                "temperature": 0,
            },
        ),
    ]
    for path, body in cases:
        _same_output(cluster, path, body)
    # A stop string from the greedy text, after the first token and at it.
    body = _completion(_prompt(6, 40), 16, ignore_eos=True)
    text = _same_output(cluster, "/v1/completions", body)["choices"][0]["text"]
    for stop in (text[5:7], text[:1]):
        got = _same_output(cluster, "/v1/completions", {**body, "stop": [stop]})
        assert got["choices"][0]["finish_reason"] == "stop"
    after = _transfers(cluster["split"])
    assert after["transfers_total"] - before["transfers_total"] >= 5
    assert after["pulled"] - before["pulled"] >= 61 // BLOCK and after["transfer_failures_total"] == 0
    assert _compilations(cluster) == compiled  # reading and writing blocks uses the warmed-up moves
    _both_free(cluster)


def test_transferred_blocks_are_counted_and_held_ones_skipped(cluster):
    prompt = _prompt(10, 5 * BLOCK)  # 5 full blocks; the decode worker recomputes only the first token's position
    before = _transfers(cluster["split"])
    _same_output(cluster, "/v1/completions", _completion(prompt, 4, ignore_eos=True))
    mid = _transfers(cluster["split"])
    assert mid["transfers_total"] - before["transfers_total"] == 1
    assert mid["transfer_duration_seconds_count"] - before["transfer_duration_seconds_count"] == 1  # its time too
    assert mid["pulled"] - before["pulled"] == 5 and mid["skipped"] == before["skipped"]
    block_bytes = (mid["transfer_bytes_total"] - before["transfer_bytes_total"]) / 5
    assert block_bytes > 0
    # The decode worker holds the prompt's blocks now: the next request's transfer skips them.
    _same_output(cluster, "/v1/completions", _completion(prompt + [7, 8, 9], 4, ignore_eos=True))
    after = _transfers(cluster["split"])
    assert after["pulled"] == mid["pulled"] and after["skipped"] - mid["skipped"] == 5
    assert after["transfer_bytes_total"] == mid["transfer_bytes_total"]
    _both_free(cluster)


def _generate(port: int, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    channel, stub = _stub(port)
    with channel:
        return list(stub.Generate(request, timeout=60))


def _params(max_tokens: int) -> str:
    return params_to_json(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _lease(port: int, request_id: str, prompt: list[int]) -> tuple[pb.KVLease, int]:
    """Prefill `prompt` on a prefill worker as a router does: the lease of its blocks, and the first token."""
    messages = _generate(
        port,
        pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params_json=_params(1), hold_kv=True
        ),
    )
    assert messages[-1].finish_reason == "length" and messages[-1].HasField("lease")
    return messages[-1].lease, messages[-1].token_ids[-1]


def test_a_lease_nobody_pulls_is_freed_at_its_timeout(cluster):
    port = cluster["ports"]["prefill"]
    lease, _ = _lease(port, "unpulled", _prompt(20, 5 * BLOCK))
    assert lease.num_blocks == 5 and lease.timeout_s == LEASE_TIMEOUT
    reply = _load(port)
    assert reply.kv_leases == 1 and snapshot_from_json(reply.snapshot_json).kv.pinned == 5  # held, not evictable
    _all_free(port, timeout=LEASE_TIMEOUT + 10)
    channel, stub = _stub(port)
    with channel, pytest.raises(grpc.RpcError) as err:
        list(stub.PullKV(pb.PullKVRequest(lease_id=lease.lease_id, first_block=0, num_blocks=5), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_going_away_mid_transfer_leaks_nothing(cluster):
    prefill = cluster["ports"]["prefill"]
    # A puller that stops reading after the first message: the lease stays until the request's abort.
    lease, _ = _lease(prefill, "abandoned", _prompt(30, 20 * BLOCK))
    channel, stub = _stub(prefill)
    with channel:
        call = stub.PullKV(pb.PullKVRequest(lease_id=lease.lease_id, first_block=0, num_blocks=lease.num_blocks))
        first = next(call)
        assert first.first_block == 0 and first.num_blocks > 0 and first.k and first.v
        call.cancel()
        assert _load(prefill).kv_leases == 1
        stub.Abort(pb.AbortRequest(request_id="abandoned"), timeout=30)
    _all_free(prefill)
    # A decode worker whose caller goes away while it pulls: its hold and the prefill's lease go.
    decode = cluster["ports"]["decode"]
    prompt = _prompt(31, 20 * BLOCK)
    lease, first = _lease(prefill, "cut", prompt)
    channel, stub = _stub(decode)
    with channel:
        call = stub.Generate(
            pb.GenerateRequest(
                request_id="cut",
                prompt_token_ids=prompt + [first],
                sampling_params_json=_params(50),
                kv_source=pb.KVSource(address=f"127.0.0.1:{prefill}", lease=lease),
            )
        )
        call.cancel()
    _both_free(cluster)
    # A client that disconnects once the first token is out, while the decode worker pulls the prompt.
    for seed in (32, 33, 34):
        stream = Stream(cluster["split"], _completion(_prompt(seed, 25 * BLOCK), 50, ignore_eos=True), KEY_A)
        stream.first_text_event()
        stream.close()
    _both_free(cluster)


def test_a_lease_gone_before_the_pull_leaves_the_decode_worker_to_recompute(cluster):
    prefill, decode = cluster["ports"]["prefill"], cluster["ports"]["decode"]
    prompt = _prompt(40, 4 * BLOCK + 3)
    lease, first = _lease(prefill, "late", prompt)
    channel, stub = _stub(prefill)
    with channel:
        assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=30).released
    got = _generate(
        decode,
        pb.GenerateRequest(
            request_id="late",
            prompt_token_ids=prompt + [first],
            sampling_params_json=_params(5),
            kv_source=pb.KVSource(address=f"127.0.0.1:{prefill}", lease=lease),
        ),
    )
    transfer = got[0].transfer
    assert transfer.blocks_pulled == 0 and "NOT_FOUND" in transfer.error
    expected = _generate(
        cluster["ports"]["both"],
        pb.GenerateRequest(request_id="late", prompt_token_ids=prompt, sampling_params_json=_params(6)),
    )
    tokens = lambda messages: [t for m in messages for t in m.token_ids]  # noqa: E731
    assert [first, *tokens(got)] == tokens(expected)
    _both_free(cluster)


def test_a_decode_worker_dead_before_its_half_gets_the_half_retried_on_another(cluster):
    """The router has not noticed that the first decode worker died (it checks every 10
    minutes), so a request's decode half goes there first (an idle tie goes to the first
    worker), fails before streaming anything, and is retried on the other decode worker, which
    pulls the prompt's blocks from the prefill worker: the colocated output, nothing leaked."""
    ports = cluster["ports"]
    spare_port = free_port()
    spare = start_worker(spare_port, [*SMALL_ENGINE, "--role", "decode"], jax.config.jax_compilation_cache_dir)
    spare.wait_for("worker listening", timeout=900)
    router, endpoint = start_router(
        [],
        "--prefill-worker",
        f"127.0.0.1:{ports['prefill']}",
        "--decode-worker",
        f"127.0.0.1:{spare_port}",
        "--decode-worker",
        f"127.0.0.1:{ports['decode']}",
        "--health-check-interval",
        "600",
    )
    try:
        router.wait_for("Running on", timeout=120)
        spare.proc.kill()  # SIGKILL
        spare.finish(30)
        body = _completion(_prompt(50, 5 * BLOCK + 2), 8, ignore_eos=True)
        before = _transfers(endpoint)
        got = send(endpoint, "POST", "/v1/completions", body)
        want = send(cluster["colo"], "POST", "/v1/completions", body)
        assert got.status == want.status == 200, got.text
        _close(got.json["choices"], want.json["choices"])
        router.wait_for("retrying on", timeout=10)
        after = _transfers(endpoint)
        assert after["pulled"] - before["pulled"] == 5 and after["transfer_failures_total"] == 0
        _both_free(cluster)
    finally:
        router.terminate()
        router.finish(60)
    assert "Traceback" not in router.output, router.output


def test_a_decode_worker_dead_mid_stream_has_the_sequence_resumed_on_another(cluster):
    """Streams whose decode worker is SIGKILLed after they started go on on the other decode
    worker from their prompt plus the tokens out (recomputed there): no error, no break, the
    colocated text (greedy and seeded), usage counted once, nothing leaked."""
    ports = cluster["ports"]
    spare_port = free_port()
    spare = start_worker(spare_port, [*SMALL_ENGINE, "--role", "decode"], jax.config.jax_compilation_cache_dir)
    spare.wait_for("worker listening", timeout=900)
    router, endpoint = start_router(
        [],
        "--prefill-worker",
        f"127.0.0.1:{ports['prefill']}",
        "--decode-worker",
        f"127.0.0.1:{spare_port}",
        "--decode-worker",
        f"127.0.0.1:{ports['decode']}",
        "--health-check-interval",
        "0.3",
    )
    try:
        router.wait_for("Running on", timeout=120)
        bodies = [
            _completion(_prompt(60, 3 * BLOCK + 5), 200, ignore_eos=True),
            _completion(_prompt(61, 2 * BLOCK + 1), 200, ignore_eos=True, temperature=0.9, seed=11),
        ]
        streams = [Stream(endpoint, {**b, "stream_options": {"include_usage": True}}, None) for b in bodies]
        # The first goes to the spare (an idle tie); its first token comes from the prefill worker:
        # kill the spare once it has streamed tokens of its own.
        firsts = [[s.first_text_event()] for s in streams]
        while len(firsts[0]) < 4:
            firsts[0].append(streams[0].next_event())
        spare.proc.kill()  # SIGKILL mid-stream
        spare.finish(30)
        for body, stream, first in zip(bodies, streams, firsts):
            events = [*first, *stream.rest()]
            stream.close()
            assert not [e for e in events if "error" in e], events
            assert events[-1] == "[DONE]"
            text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
            want = send(cluster["colo"], "POST", "/v1/completions", body)
            assert text == want.json["choices"][0]["text"]
            usage = [e["usage"] for e in events[:-1] if e.get("usage")]
            assert [(u["prompt_tokens"], u["completion_tokens"]) for u in usage] == [(len(body["prompt"]), 200)]
        router.wait_for("resuming it on", timeout=10)
        _both_free(cluster)
    finally:
        router.terminate()
        router.finish(60)
    assert "Traceback" not in router.output, router.output


@pytest.fixture(scope="module")
def device_pair(cluster):
    """A prefill and a decode worker with --kv-transport device, behind their own router."""
    cache_dir = jax.config.jax_compilation_cache_dir
    ports = {"prefill": free_port(), "decode": free_port()}
    procs = {
        role: start_worker(port, [*SMALL_ENGINE, "--role", role, "--kv-transport", "device"], cache_dir)
        for role, port in ports.items()
    }
    for proc in procs.values():
        proc.wait_for("KV transfer server on", timeout=900)
        proc.wait_for("worker listening", timeout=120)
    router, endpoint = start_router(
        [],
        "--prefill-worker",
        f"127.0.0.1:{ports['prefill']}",
        "--decode-worker",
        f"127.0.0.1:{ports['decode']}",
        "--api-key",
        KEY_A,
    )
    router.wait_for("Running on", timeout=120)
    yield dict(cluster, ports=ports, split_device=endpoint, grpc_ports=cluster["ports"])
    for proc in [router, *procs.values()]:
        proc.terminate()
    for proc in [router, *procs.values()]:
        proc.finish(60)
    output = "\n".join(p.output for p in [router, *procs.values()])
    assert "Traceback" not in output, output


def test_blocks_moved_device_to_device_give_the_colocated_output(device_pair):
    before = _transfers(device_pair["split_device"])
    compiled = _compilations(device_pair)
    cases = [
        _completion(_prompt(60, 29 * BLOCK + 3), 6, ignore_eos=True, logprobs=2),  # 29 full blocks
        _completion(_prompt(61, 3 * BLOCK), 8, ignore_eos=True),
        _completion(_prompt(62, 24), 10, temperature=0.8, seed=7, n=2, ignore_eos=True),
    ]
    for body in cases:
        _same_output(device_pair, "/v1/completions", body, split_router="split_device")
    after = _transfers(device_pair["split_device"])
    moved = after["transfers_total"] - before["transfers_total"]
    # Each of the three prompts moves its blocks device to device at least once; the second choice of
    # the n=2 request may find them already in the decode worker's cache and move nothing.
    assert moved >= 4 and 3 <= after["device_transfers_total"] - before["device_transfers_total"] <= moved
    assert after["pulled"] - before["pulled"] >= 29 + 3 and after["transfer_failures_total"] == 0
    assert _compilations(device_pair) == compiled  # staging and writing use the warmed-up block moves
    _both_free(device_pair)


def test_a_device_decode_worker_pulls_bytes_from_a_prefill_worker_without_a_transfer_server(device_pair):
    """A lease that names no transfer server is pulled as bytes; one that names a server its
    prefill worker does not run (StageKV refused) falls back to bytes too."""
    prefill, decode = device_pair["grpc_ports"]["prefill"], device_pair["ports"]["decode"]
    tokens = lambda messages: [t for m in messages for t in m.token_ids]  # noqa: E731
    for seed, forged_address in ((70, ""), (71, "127.0.0.1:1")):
        prompt = _prompt(seed, 4 * BLOCK + 3)
        lease, first = _lease(prefill, f"bytes-{seed}", prompt)
        assert lease.transfer_address == ""
        lease.transfer_address = forged_address
        got = _generate(
            decode,
            pb.GenerateRequest(
                request_id=f"bytes-{seed}",
                prompt_token_ids=prompt + [first],
                sampling_params_json=_params(5),
                kv_source=pb.KVSource(address=f"127.0.0.1:{prefill}", lease=lease),
            ),
        )
        transfer = got[0].transfer
        assert (transfer.transport, transfer.blocks_pulled, transfer.error) == ("grpc", 4, "")
        expected = _generate(
            device_pair["grpc_ports"]["both"],
            pb.GenerateRequest(request_id=f"ref-{seed}", prompt_token_ids=prompt, sampling_params_json=_params(6)),
        )
        assert [first, *tokens(got)] == tokens(expected)
    _all_free(prefill)
    _both_free(device_pair)
