"""`jaxserve launch`: topology files checked before anything starts, and a router with two workers
placed on a local Ray cluster that the test starts (`ray start --head`), serving a request, then
stopped cleanly by SIGTERM (every process gone, the cluster's resources free again); a topology the
cluster has no room for is refused once its placement times out."""

from __future__ import annotations

import socket
import sys

import jax
import pytest
import ray
import yaml

from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from router_cluster import Endpoint, workers
from server.cluster.launch.topology import TopologyError, parse_topology
from server_harness import send


def _topology(**overrides: object) -> dict:
    return {"model": "tiny-random", "workers": [{"role": "both", "count": 2}], **overrides}


@pytest.mark.parametrize("overrides, message", [
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
])
def test_a_bad_topology_is_refused_with_the_key_it_names(overrides, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(_topology(**overrides))


def test_worker_specs_carry_each_workers_bundle_and_flags():
    topology = parse_topology(_topology(placement="SPREAD", workers=[
        {"role": "prefill", "tp": 2, "gpus": 2, "cpus": 4, "ports": [9000], "args": ["--max-num-seqs", 8]},
        {"role": "decode", "count": 2}]))
    specs = topology.worker_specs()
    assert [(s.name, s.role, s.bundle) for s in specs] == [
        ("worker-0", "prefill", {"CPU": 4.0, "GPU": 2}), ("worker-1", "decode", {"CPU": 1.0}),
        ("worker-2", "decode", {"CPU": 1.0})]
    assert specs[0].flags == ("--model", "tiny-random", "--port", "9000", "--role", "prefill",
                              "--tensor-parallel-size", "2", "--max-num-seqs", "8")
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


def test_launch_serves_through_a_router_and_two_workers_on_a_local_ray_cluster(tmp_path, _compilation_cache):
    gcs_port, router_port = free_port(), free_port()
    worker_args = [*SMALL_ENGINE, "--compilation-cache-dir", jax.config.jax_compilation_cache_dir]
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(_topology(
        router={"host": "127.0.0.1", "port": router_port, "args": ["--health-check-interval", "0.5"]},
        workers=[{"role": "both", "count": 2, "cpus": 1, "args": worker_args}])))
    head_command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                    "--node-ip-address", "127.0.0.1", "--port", str(gcs_port), "--num-cpus", "2",
                    "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats"]
    with ChildProcess(head_command) as head:
        head.wait_for("Ray runtime started", timeout=180)
        try:
            too_big = tmp_path / "too_big.yaml"
            too_big.write_text(yaml.safe_dump(_topology(workers=[{"role": "both", "count": 2, "cpus": 1.5}])))
            with ChildProcess(jaxserve("launch", "--config", str(too_big), "--address", f"127.0.0.1:{gcs_port}",
                                       "--placement-timeout", "3")) as refused:
                assert refused.finish(timeout=120) != 0
            assert "the cluster has no room for 2 worker bundles" in refused.output, refused.output
            with ChildProcess(jaxserve("launch", "--config", str(config), "--address",
                                       f"127.0.0.1:{gcs_port}", "--stop-timeout", "20")) as launch:
                launch.wait_for("[launch] router on", timeout=600)
                router = Endpoint(router_port)
                placed = workers(router)
                assert [w["status"] for w in placed] == ["up", "up"], placed
                worker_ports = [int(w["address"].rsplit(":", 1)[1]) for w in placed]
                reply = send(router, "POST", "/v1/completions", {"model": "tiny-random", "prompt": "Hello there",
                                                                  "max_tokens": 6, "temperature": 0,
                                                                  "ignore_eos": True}, key=None)
                assert reply.status == 200, reply.text
                assert reply.json["usage"]["completion_tokens"] == 6
                assert sum(w["routed"] for w in workers(router)) == 1
                launch.terminate()
                assert launch.finish(timeout=120) == 0, launch.output
            assert "[launch] stopped" in launch.output
            assert all(_refuses_connections(p) for p in [router_port, *worker_ports])
            ray.init(address=f"127.0.0.1:{gcs_port}", log_to_driver=False)
            try:
                assert ray.available_resources().get("CPU") == 2.0  # the placement group is gone
            finally:
                ray.shutdown()
        finally:
            head.terminate()
            head.finish(timeout=120)
