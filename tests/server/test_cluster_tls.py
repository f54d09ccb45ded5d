"""TLS inside the cluster and HTTPS outside it: a `jaxserve worker` serving mutual TLS, routers
presenting the cluster CA's certificate, the worker's KV pool reached through its master's mutual-TLS
gateway, and the public API over HTTPS (child processes, loopback).

Certificates are made for the run (tests/server/tls_certs.py): the cluster's CA signs the worker's,
the routers' and the HTTPS server's; a second CA signs a rogue certificate.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import jax
import openai
import pytest
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from router_cluster import start_worker
from tls_certs import issue, make_ca

from server.cluster.launch.mooncake_master import PoolMaster, mooncake_missing
from server.cluster.pool_tls import ForwarderProcess
from server.cluster.worker import worker_pb2 as pb
from server.cluster.worker.wire import snapshot_from_json
from server.cluster.worker.worker_pb2_grpc import WorkerStub
from server.grpc_api import jaxserve_pb2 as api_pb
from server.grpc_api import jaxserve_pb2_grpc as api_grpc
from server.tls import ClusterTLS, TLSConfigError, https_context


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "cluster-ca")
    rogue_ca = make_ca(d, "rogue-ca")
    return {
        "ca": ca.cert,
        "worker": issue(ca, d, "worker"),
        "router": issue(ca, d, "router"),
        "https": issue(ca, d, "https"),
        "rogue": issue(rogue_ca, d, "rogue"),
    }


def _cluster_flags(pki, name: str) -> list[str]:
    cert, ca = pki[name], pki["ca"]
    return ["--cluster-tls-cert", str(cert.cert), "--cluster-tls-key", str(cert.key), "--cluster-tls-ca", str(ca)]


def _https_flags(pki) -> list[str]:
    return ["--ssl-certfile", str(pki["https"].cert), "--ssl-keyfile", str(pki["https"].key)]


@pytest.fixture(scope="module")
def pool_flags(pki):
    """A KV pool for the worker when Mooncake is installed: a real master on loopback behind its
    mutual-TLS gateway (server/cluster/pool_tls.py), which the worker dials with its certificate."""
    if mooncake_missing() is not None:
        yield []
        return
    master = PoolMaster()
    master.start()
    tls = ClusterTLS.load(pki["worker"].cert, pki["worker"].key, pki["ca"])
    gateway = ForwarderProcess("accept", "127.0.0.1:0", f"127.0.0.1:{master.rpc_port}", tls)
    try:
        yield ["--kv-pool", f"mooncake://{gateway.address}", "--kv-pool-segment-bytes", str(32 << 20)]
    finally:
        gateway.close()
        master.kill()


@pytest.fixture(scope="module")
def cluster(pki, pool_flags, _compilation_cache):
    """A worker serving mutual TLS only (its KV pool's master RPC too, where Mooncake is installed);
    router A (HTTPS, and its gRPC API on TLS) and router B (HTTPS that requires client
    certificates), both presenting the cluster certificate to the worker."""
    worker_port = free_port()
    cache_dir = jax.config.jax_compilation_cache_dir
    worker = start_worker(worker_port, [*SMALL_ENGINE, *_cluster_flags(pki, "worker"), *pool_flags], cache_dir)
    routers = []
    grpc_port = free_port()
    try:
        worker.wait_for("worker listening", timeout=600)
        for extra in (["--grpc-port", str(grpc_port)], ["--ssl-ca-certs", str(pki["ca"])]):
            port = free_port()
            flags = ["--worker", f"127.0.0.1:{worker_port}", *_cluster_flags(pki, "router"), *_https_flags(pki)]
            routers.append((ChildProcess(jaxserve("router", "--port", str(port), *flags, *extra)), port))
        for proc, _ in routers:
            proc.wait_for("Running on", timeout=120)
        yield {
            "worker_port": worker_port,
            "https_port": routers[0][1],
            "grpc_port": grpc_port,
            "mtls_https_port": routers[1][1],
        }
    finally:
        for proc, _ in routers:
            proc.terminate()
            assert proc.finish() == 0, proc.output
        worker.terminate()
        assert worker.finish() == 0, worker.output


def _channel_credentials(pki, client: str | None, ca: str = "ca") -> grpc.ChannelCredentials:
    root = Path(pki[ca]).read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root)
    return grpc.ssl_channel_credentials(
        root, private_key=pki[client].key.read_bytes(), certificate_chain=pki[client].cert.read_bytes()
    )


def _health(port: int, credentials: grpc.ChannelCredentials | None) -> pb.HealthResponse:
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        return WorkerStub(channel).Health(pb.HealthRequest(), timeout=10)


def _https_client(pki, port: int, client_cert: bool = False) -> openai.OpenAI:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if client_cert:
        context.load_cert_chain(str(pki["router"].cert), str(pki["router"].key))
    return openai.OpenAI(
        base_url=f"https://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        http_client=openai.DefaultHttpxClient(verify=context),
    )


def _complete(client: openai.OpenAI) -> openai.types.Completion:
    model = client.models.list().data[0].id
    return client.completions.create(
        model=model, prompt="TLS all the way", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )


def _worker_snapshot(pki, port: int):
    """The worker's load report, read over mutual TLS with the router's certificate."""
    with grpc.secure_channel(f"127.0.0.1:{port}", _channel_credentials(pki, "router")) as channel:
        return snapshot_from_json(WorkerStub(channel).Load(pb.LoadRequest(), timeout=30).snapshot_json)


def test_router_with_the_cluster_cert_serves_over_https(cluster, pki):
    reply = _complete(_https_client(pki, cluster["https_port"]))
    assert reply.usage.completion_tokens == 6 and reply.choices[0].text
    snapshot = _worker_snapshot(pki, cluster["worker_port"])  # its pool is all free afterwards
    assert not snapshot.has_unfinished and snapshot.kv.used == 0


def test_the_workers_kv_pool_runs_through_its_mutual_tls_gateway(cluster, pki, pool_flags):
    if not pool_flags:
        pytest.skip(mooncake_missing())
    client = _https_client(pki, cluster["https_port"])
    prompt = [(5 * i) % 150 + 3 for i in range(70)]  # 8 full blocks, written through to the pool
    client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 30
    while (tiers := _worker_snapshot(pki, cluster["worker_port"]).tiers).pool_written_blocks < 8:
        assert time.monotonic() < deadline, tiers
        time.sleep(0.2)
    assert tiers.lower_tiers == ("pool",)


@pytest.fixture(scope="module")
def disaggregated(pki, cluster):
    """A prefill and a decode worker on mutual TLS, behind a router (HTTPS) with the cluster certificate:
    the decode worker pulls the prompt's KV blocks from the prefill worker over mutual TLS."""
    cache_dir = jax.config.jax_compilation_cache_dir
    ports = {"prefill": free_port(), "decode": free_port()}
    workers = [
        start_worker(ports[role], [*SMALL_ENGINE, "--role", role, *_cluster_flags(pki, "worker")], cache_dir)
        for role in ("prefill", "decode")
    ]
    router_port = free_port()
    flags = ["--prefill-worker", f"127.0.0.1:{ports['prefill']}", "--decode-worker", f"127.0.0.1:{ports['decode']}"]
    router = ChildProcess(
        jaxserve("router", "--port", str(router_port), *flags, *_cluster_flags(pki, "router"), *_https_flags(pki))
    )
    try:
        for proc in workers:
            proc.wait_for("worker listening", timeout=600)
        router.wait_for("Running on", timeout=120)
        deadline = time.monotonic() + 60  # the router serves once the decode worker is up
        while json.loads(_https_get(pki, router_port, "/health"))["prefill_workers"][0]["status"] != "up":
            assert time.monotonic() < deadline, "the prefill worker did not come up"
            time.sleep(0.2)
        yield router_port
    finally:
        for proc in [router, *workers]:
            proc.terminate()
        for proc in [router, *workers]:
            assert proc.finish() == 0, proc.output


def _https_get(pki, port: int, path: str) -> str:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=context) as reply:
        return reply.read().decode()


def test_kv_handoff_between_workers_runs_over_mutual_tls(disaggregated, cluster, pki):
    prompt = list(range(5, 45))  # 40 tokens: 5 full blocks to hand over
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    split = _https_client(pki, disaggregated)
    colocated = _https_client(pki, cluster["https_port"])
    model = split.models.list().data[0].id
    split_text = split.completions.create(model=model, **body).choices[0].text
    assert split_text == colocated.completions.create(model=model, **body).choices[0].text
    text = _https_get(pki, disaggregated, "/metrics")
    assert re.search(r"^jaxserve_kv_transfers_total 1\.0$", text, re.MULTILINE), text
    pulled = re.search(r'^jaxserve_kv_transfer_blocks_total\{kind="pulled"\} (\S+)$', text, re.MULTILINE)
    assert pulled and float(pulled.group(1)) >= 4, text


def test_https_client_that_does_not_trust_the_ca_is_refused(cluster):
    client = openai.OpenAI(base_url=f"https://127.0.0.1:{cluster['https_port']}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


def test_https_with_client_certificates_required(cluster, pki):
    assert _complete(_https_client(pki, cluster["mtls_https_port"], client_cert=True)).usage.completion_tokens == 6
    with pytest.raises(openai.APIConnectionError):  # no client certificate: the handshake fails
        _https_client(pki, cluster["mtls_https_port"]).models.list()


def test_public_grpc_api_serves_tls_with_the_https_files(cluster, pki):
    address = f"127.0.0.1:{cluster['grpc_port']}"
    with grpc.secure_channel(address, _channel_credentials(pki, None)) as channel:
        stub = api_grpc.JaxServeStub(channel)
        model = stub.ListModels(api_pb.ListModelsRequest(), timeout=30).models[0].id
        request = api_pb.GenerateRequest(
            model=model, text="hello", sampling_params=api_pb.SamplingParams(max_tokens=4, ignore_eos=True)
        )
        replies = list(stub.Generate(request, timeout=60))
    assert replies[-1].usage.completion_tokens == 4
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        api_grpc.JaxServeStub(channel).ListModels(api_pb.ListModelsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_worker_accepts_a_client_with_a_ca_signed_cert(cluster, pki):
    assert _health(cluster["worker_port"], _channel_credentials(pki, "router")).serving


@pytest.mark.parametrize("client", ["plaintext", "no client cert", "cert from another CA"])
def test_worker_refuses_a_client_without_a_ca_signed_cert(cluster, pki, client):
    credentials = {
        "plaintext": None,
        "no client cert": _channel_credentials(pki, None),
        "cert from another CA": _channel_credentials(pki, "rogue"),
    }[client]
    with pytest.raises(grpc.RpcError) as e:
        _health(cluster["worker_port"], credentials)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_router_without_the_cluster_cert_gets_no_worker(cluster):
    port = free_port()
    command = jaxserve("router", "--port", str(port), "--worker", f"127.0.0.1:{cluster['worker_port']}")
    result = subprocess.run([*command, "--worker-wait-timeout", "3"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no worker served within 3 s" in result.stdout + result.stderr


def test_wrong_tls_files_stop_the_command_with_the_flag_named(pki, tmp_path):
    command = jaxserve("router", "--worker", "127.0.0.1:1", "--port", str(free_port()))
    missing = [*command, *_cluster_flags(pki, "router")]
    missing[missing.index("--cluster-tls-cert") + 1] = str(tmp_path / "absent.pem")
    result = subprocess.run(missing, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--cluster-tls-cert: no such file" in result.stderr
    result = subprocess.run(
        [*command, "--ssl-certfile", str(pki["https"].cert)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "give both --ssl-certfile and --ssl-keyfile" in result.stderr


def test_cluster_tls_files_are_checked(pki, tmp_path):
    ca, worker, router = pki["ca"], pki["worker"], pki["router"]
    assert ClusterTLS.load(worker.cert, worker.key, ca).cert == worker.cert.read_bytes()
    with pytest.raises(TLSConfigError, match="does not match"):
        ClusterTLS.load(worker.cert, router.key, ca)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(TLSConfigError, match="--cluster-tls-ca: .* is not a PEM file"):
        ClusterTLS.load(worker.cert, worker.key, not_pem)
    with pytest.raises(TLSConfigError, match="--cluster-tls-key: no such file"):
        ClusterTLS.load(worker.cert, tmp_path / "absent.key", ca)


def test_https_context_checks_its_files(pki):
    https = pki["https"]
    assert https_context(None, None, None) is None
    context = https_context(str(https.cert), str(https.key), str(pki["ca"]))
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert https_context(str(https.cert), str(https.key), None).verify_mode == ssl.CERT_NONE
    with pytest.raises(TLSConfigError, match="--ssl-ca-certs needs"):
        https_context(None, None, str(pki["ca"]))
    with pytest.raises(TLSConfigError, match="does not match"):
        https_context(str(https.cert), str(pki["router"].key), None)
