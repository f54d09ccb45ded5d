"""`jaxserve launch`: topology files checked before anything starts, and a router with two workers
placed on a local Ray cluster that the test starts (`ray start --head`), serving a request, then
stopped cleanly by SIGTERM (every process gone, the cluster's resources free again); a topology the
cluster has no room for is refused once its placement times out.

Which cluster: a launch without --address, on a machine whose Ray discovery file names a cluster
that is gone, starts a local cluster of its own on loopback (reading and writing no discovery
file), serves, gets a SIGKILLed worker back (restarted by Ray, taken back by the router), and stops
leaving no Ray process or file behind; `--address auto` with that file, or an address nobody
answers at, fails within seconds with a message. Every Ray file of these tests lives in a
temporary directory (RAY_TMPDIR, --temp-dir) removed at the end, so no stale discovery file is left.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import jax
import pytest
import ray
import yaml
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from router_cluster import Endpoint, wait_worker_status, workers
from server_harness import send
from tls_certs import issue, make_ca

from server.cluster.launch.mooncake_master import mooncake_missing
from server.cluster.launch.ray_cluster import ClusterNotFoundError, RayTarget, check_reachable, choose_cluster
from server.cluster.launch.topology import TopologyError, parse_topology


def _topology(**overrides: object) -> dict:
    return {"model": "tiny-random", "workers": [{"role": "both", "count": 2}], **overrides}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model": ""}, "model:"),
        ({"placement": "ANYWHERE"}, "placement: one of PACK"),
        ({"routr": {}}, "unknown key 'routr'"),
        ({"router": {"port": 70000}}, "router.port"),
        ({"router": {"args": ["--worker", "h:1"]}}, "router.args: --worker is set by the launcher"),
        ({"workers": []}, "workers: a non-empty list"),
        ({"workers": [{"role": "prefill"}]}, "at least one worker of role both or decode"),
        ({"workers": [{"role": "prefill"}, {"role": "both"}]}, "role prefill needs workers of role decode"),
        ({"workers": [{"role": "both"}, {"role": "cook"}]}, "workers[1].role"),
        ({"workers": [{"count": 0}]}, "workers[0].count: a positive integer"),
        ({"workers": [{"tp": 2, "gpus": 3}]}, "workers[0].gpus: 0 or a multiple of tp"),
        ({"workers": [{"count": 2, "ports": [9000]}]}, "workers[0].ports: a list of 2 ports"),
        ({"workers": [{"args": ["--port=9"]}]}, "workers[0].args: --port is set by the launcher"),
        ({"workers": [{"args": [True]}]}, "workers[0].args: a list of command-line words"),
        ({"kv_pool": {"port": -1}}, "kv_pool.port: a port"),
        ({"kv_pool": {"host": "h"}}, "kv_pool: unknown key 'host'"),
        ({"workers": [{"args": ["--kv-pool", "mooncake://h:1"]}]}, "--kv-pool is set by the launcher"),
    ],
)
def test_a_bad_topology_is_refused_with_the_key_it_names(overrides, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(_topology(**overrides))


def test_worker_specs_carry_each_workers_bundle_and_flags():
    topology = parse_topology(
        _topology(
            placement="SPREAD",
            workers=[
                {"role": "prefill", "tp": 2, "gpus": 2, "cpus": 4, "ports": [9000], "args": ["--max-num-seqs", 8]},
                {"role": "decode", "count": 2},
            ],
        )
    )
    specs = topology.worker_specs()
    assert [(s.name, s.role, s.bundle) for s in specs] == [
        ("worker-0", "prefill", {"CPU": 4.0, "GPU": 2}),
        ("worker-1", "decode", {"CPU": 1.0}),
        ("worker-2", "decode", {"CPU": 1.0}),
    ]
    assert specs[0].flags == (
        "--model",
        "tiny-random",
        "--port",
        "9000",
        "--role",
        "prefill",
        "--tensor-parallel-size",
        "2",
        "--max-num-seqs",
        "8",
    )
    assert specs[1].flags[2:4] == ("--port", "0")  # a free port of its node, printed by the worker


def test_launch_refuses_a_bad_file_before_it_starts_anything(tmp_path):
    config = tmp_path / "topology.yaml"
    config.write_text("model: tiny-random\nworkers: [{role: both, cuont: 2}]\n")
    with ChildProcess(jaxserve("launch", "--config", str(config))) as launch:
        assert launch.finish() != 0
    assert "workers[0]: unknown key 'cuont'" in launch.output


def _refuses_connections(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def ray_tmp(monkeypatch):
    """A temporary directory for every Ray file of the test and its children (RAY_TMPDIR, and
    TMPDIR for the launcher's own cluster); at the end, no process uses it and it is removed."""
    root = Path(tempfile.mkdtemp(prefix="jr-"))  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", str(root))
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield root
    deadline = time.monotonic() + 30
    while (users := _processes_using(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in users:  # (a failed test's leftovers: end them, then fail)
        os.kill(pid, signal.SIGKILL)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    assert not users, f"Ray processes left behind: {users}"


def _processes_using(root: Path) -> list[int]:
    """Processes whose command line names `root` (a Ray head, raylet, GCS of a test's cluster)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if str(root).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _stale_discovery_file(root: Path) -> tuple[Path, str]:
    """A discovery file naming a cluster that is gone (nothing listens at its address)."""
    path = root / "ray" / "ray_current_cluster"
    path.parent.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    path.write_text(address)
    return path, address


def test_which_cluster_a_launch_uses():
    assert choose_cluster(None, {}) == RayTarget(None, "a local cluster")
    assert choose_cluster(None, {"RAY_ADDRESS": "h:1"}) == RayTarget("h:1", "RAY_ADDRESS")
    assert choose_cluster("h:2", {"RAY_ADDRESS": "h:1"}) == RayTarget("h:2", "--address")
    assert choose_cluster("auto", {"RAY_ADDRESS": "h:1"}) == RayTarget("h:1", "RAY_ADDRESS")
    with pytest.raises(ClusterNotFoundError, match="names no cluster; leave out --address"):
        choose_cluster("auto", {"RAY_TMPDIR": "/nonexistent"})
    with pytest.raises(ClusterNotFoundError, match="a Ray cluster is HOST:PORT"):
        check_reachable(RayTarget("nowhere", "--address"))
    check_reachable(RayTarget(None, "a local cluster"))  # started by the launch itself


@pytest.mark.parametrize("how", ["auto", "address"])
def test_a_launch_told_of_a_cluster_that_is_gone_fails_in_seconds(how, ray_tmp, tmp_path):
    path, address = _stale_discovery_file(ray_tmp)
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(_topology()))
    flag = "auto" if how == "auto" else address
    start = time.monotonic()
    with ChildProcess(jaxserve("launch", "--config", str(config), "--address", flag)) as launch:
        assert launch.finish(timeout=60) != 0
    assert f"no Ray cluster answers at {address}" in launch.output, launch.output
    source = f"from Ray's discovery file {path} (a stale file" if how == "auto" else "from --address"
    assert source in launch.output, launch.output
    assert "Failed to connect to GCS" not in launch.output
    assert time.monotonic() - start < 60  # (Ray itself retries for minutes)


def test_launch_without_an_address_starts_its_own_cluster_and_gets_a_killed_worker_back(
    tmp_path, ray_tmp, _compilation_cache
):
    path, stale = _stale_discovery_file(ray_tmp)
    router_port = free_port()
    worker_args = [*SMALL_ENGINE, "--compilation-cache-dir", jax.config.jax_compilation_cache_dir]
    config = tmp_path / "topology.yaml"
    config.write_text(
        yaml.safe_dump(
            _topology(
                router={"host": "127.0.0.1", "port": router_port, "args": ["--health-check-interval", "0.3"]},
                workers=[{"role": "both", "count": 2, "cpus": 1, "args": worker_args}],
            )
        )
    )
    body = {"model": "tiny-random", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ChildProcess(
        jaxserve("launch", "--config", str(config), "--stop-timeout", "20", "--worker-restarts", "1")
    ) as launch:
        launch.wait_for("[launch] starting a local Ray cluster on 127.0.0.1", timeout=60)
        line = launch.wait_for("[launch] router on", timeout=600)
        router = Endpoint(router_port)
        placed = workers(router)
        assert [w["status"] for w in placed] == ["up", "up"], placed
        assert all(w["address"].startswith("127.0.0.1:") for w in placed), placed  # on loopback
        assert send(router, "POST", "/v1/completions", body, key=None).status == 200
        # Ray forwards the actor's line on its own schedule: it may come after the launcher's own lines
        started = launch.wait_for("[worker-0] started pid", timeout=60)
        pid = int(re.search(r"\[worker-0\] started pid (\d+)", started).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_worker_status(router, 0, "down", timeout=30)
        reply = send(router, "POST", "/v1/completions", body, key=None)  # the other worker serves meanwhile
        assert reply.status == 200 and reply.json["usage"]["completion_tokens"] == 6, reply.text
        launch.wait_for("[launch] worker-0 restarted", timeout=120)
        wait_worker_status(router, 0, "up", timeout=600)  # Ray restarted it, on its port
        assert workers(router)[0]["address"] == placed[0]["address"]
        launch.terminate()
        assert launch.finish(timeout=120) == 0, launch.output
    assert "[launch] stopped" in launch.output and line
    assert all(_refuses_connections(int(w["address"].rsplit(":", 1)[1])) for w in placed)
    assert _refuses_connections(router_port)
    assert path.read_text() == stale  # the discovery file was neither used nor rewritten
    assert not list(ray_tmp.glob("jaxserve-ray-*")), list(ray_tmp.iterdir())  # the launch's cluster is gone


def _cluster_tls_flags(directory: Path) -> list[str]:
    ca = make_ca(directory, "cluster-ca")
    # it must name the node's outward address too: Ray reports that one (the pool gateway listens there)
    member = issue(ca, directory, "member", (ray.util.get_node_ip_address(),))
    return [
        "--cluster-tls-cert",
        str(member.cert),
        "--cluster-tls-key",
        str(member.key),
        "--cluster-tls-ca",
        str(ca.cert),
    ]


@pytest.mark.slow  # ~100 s each; the launch that starts its own cluster covers router + two workers in CI
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "cluster-tls"])
def test_launch_serves_through_a_router_and_two_workers_on_a_local_ray_cluster(
    tls, tmp_path, ray_tmp, _compilation_cache
):
    """With cluster TLS (the router's and workers' args), the KV pool's master is behind its gateway."""
    gcs_port, router_port = free_port(), free_port()
    tls_flags = _cluster_tls_flags(tmp_path) if tls else []
    worker_args = [*SMALL_ENGINE, "--compilation-cache-dir", jax.config.jax_compilation_cache_dir, *tls_flags]
    router_args = ["--health-check-interval", "0.5", *tls_flags]
    config = tmp_path / "topology.yaml"
    config.write_text(
        yaml.safe_dump(
            _topology(
                router={
                    "host": "127.0.0.1",
                    "port": router_port,
                    "args": router_args,
                },
                workers=[{"role": "both", "count": 2, "cpus": 1, "args": worker_args}],
                **({} if mooncake_missing() else {"kv_pool": {"port": 0}}),  # the workers share a KV pool
            )
        )
    )
    head_command = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(gcs_port),
        "--num-cpus",
        "2",
        "--num-gpus",
        "0",
        "--include-dashboard",
        "false",
        "--disable-usage-stats",
        "--temp-dir",
        str(ray_tmp / "head"),
    ]
    with ChildProcess(head_command) as head:
        head.wait_for("Ray runtime started", timeout=180)
        try:
            too_big = tmp_path / "too_big.yaml"
            too_big.write_text(yaml.safe_dump(_topology(workers=[{"role": "both", "count": 2, "cpus": 1.5}])))
            with ChildProcess(
                jaxserve(
                    "launch", "--config", str(too_big), "--address", f"127.0.0.1:{gcs_port}", "--placement-timeout", "3"
                )
            ) as refused:
                assert refused.finish(timeout=120) != 0
            assert "the cluster has no room for 2 worker bundles" in refused.output, refused.output
            with ChildProcess(
                jaxserve(
                    "launch", "--config", str(config), "--address", f"127.0.0.1:{gcs_port}", "--stop-timeout", "20"
                )
            ) as launch:
                launch.wait_for("[launch] router on", timeout=600)
                assert mooncake_missing() or "[launch] KV pool master on mooncake://" in launch.output
                assert mooncake_missing() or ("(mutual TLS)" in launch.output) == tls
                router = Endpoint(router_port)
                placed = workers(router)
                assert [w["status"] for w in placed] == ["up", "up"], placed
                worker_ports = [int(w["address"].rsplit(":", 1)[1]) for w in placed]
                reply = send(
                    router,
                    "POST",
                    "/v1/completions",
                    {
                        "model": "tiny-random",
                        "prompt": "Hello there",
                        "max_tokens": 6,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                    key=None,
                )
                assert reply.status == 200, reply.text
                assert reply.json["usage"]["completion_tokens"] == 6
                assert sum(w["routed"] for w in workers(router)) == 1
                launch.terminate()
                assert launch.finish(timeout=120) == 0, launch.output
            assert "[launch] stopped" in launch.output
            assert all(_refuses_connections(p) for p in [router_port, *worker_ports])
            if not mooncake_missing():  # the pool's master (on the node's address) stopped with the launch
                host, port = next(w for w in launch.output.split() if w.startswith("mooncake://"))[11:].split(":")
                with socket.socket() as s:
                    assert s.connect_ex((host, int(port))) != 0
            ray.init(address=f"127.0.0.1:{gcs_port}", log_to_driver=False)
            try:
                assert ray.available_resources().get("CPU") == 2.0  # the placement group is gone
            finally:
                ray.shutdown()
        finally:
            head.terminate()
            head.finish(timeout=120)
