"""`--peer vllm` without vLLM installed: the command line and environment it is started with, the
missing-peer and model-directory errors, and readiness and stop through the real endpoint code
against a stand-in for the vLLM interpreter (the external boundary: a `python` that finds a fake
`vllm` whose server answers /health late and leaves a worker process behind, as vLLM's engine
core would be)."""

from __future__ import annotations

import ctypes.util
import json
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from bench.peers.runner import PeerUnavailable
from bench.serve import ServeOptions, check_serving_peer, vllm_endpoint, vllm_model_dir
from bench.server_process import ServerStartError, vllm_argv, vllm_env


def test_vllm_argv_starts_the_openai_server_module():
    assert vllm_argv("/v/bin/python", "/m", "smol", 8123, "bfloat16", 4096) == [
        "/v/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
        "--served-model-name",
        "smol",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
    ]


def test_vllm_env_binds_threads_sizes_the_cache_and_preloads_the_venvs_openmp(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    python = str(venv / "bin" / "python")
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    env = vllm_env(python, 2, 2.0)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env.get("LD_PRELOAD") == tcmalloc  # no libiomp5.so in this venv: not preloaded
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_env(python, 4, 1.5)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1.5" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["LD_PRELOAD"].split(":") == [*([tcmalloc] if tcmalloc else []), str(venv / "lib" / "libiomp5.so")]


def test_a_missing_vllm_is_a_clear_message_and_exit_code_2():
    with pytest.raises(PeerUnavailable, match="vllm-cpu"):
        check_serving_peer(ServeOptions(model="tiny-random", peer="vllm", peer_python=sys.executable))
    from jaxserve.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "sweep",
            "--model",
            "tiny-random",
            "--concurrencies",
            "1",
            "--peer",
            "vllm",
            "--peer-python",
            sys.executable,
        ]
    )
    assert args.func(args) == 2


def test_peer_model_must_be_a_hugging_face_directory(tmp_path):
    opts = ServeOptions(model="tiny-random", peer="vllm", peer_model=str(tmp_path))
    with pytest.raises(PeerUnavailable, match="no config.json"):
        vllm_model_dir(opts)
    (tmp_path / "config.json").write_text("{}")
    assert vllm_model_dir(opts) == tmp_path
    with pytest.raises(PeerUnavailable, match="--peer-model DIR"):  # tiny-random has no GGUF to convert
        vllm_model_dir(ServeOptions(model="tiny-random", peer="vllm"))


FAKE_SERVER = """
import http.server, json, os, signal, subprocess, sys, time

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
worker = subprocess.Popen([sys.executable, "-c",
                           "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "worker": worker.pid,
               "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}}, f)
if args.get("--dtype") == "float16":
    sys.exit("fake vllm: float16 is not supported on CPU")
ready_at = time.time() + 1.5

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" and time.time() >= ready_at else 503)
        self.end_headers()

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", int(args["--port"])), Handler).serve_forever()  # SIGINT: exits, worker left
"""


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch) -> str:
    """An interpreter in which `vllm` and `torch` import and `-m vllm.entrypoints.openai.api_server`
    runs FAKE_SERVER."""
    site = tmp_path / "site"
    server = site / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm" / "entrypoints", server, site / "torch"):
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text('__version__ = "0.0-fake"\n')
    (server / "api_server.py").write_text(textwrap.dedent(FAKE_SERVER))
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    return str(python)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # an unreaped zombie is dead


def test_vllm_endpoint_waits_for_health_and_stops_the_server_and_its_workers(fake_vllm_python, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    opts = ServeOptions(
        model="smol.gguf",
        served_model_name="smol",
        peer="vllm",
        peer_python=fake_vllm_python,
        peer_model=str(tmp_path / "model"),
        peer_threads=2,
        peer_kv_cache_gib=3,
        startup_timeout_s=60,
    )
    with vllm_endpoint(opts) as (endpoint, info):
        assert info["startup_s"] >= 1.5  # /health answered 503 until then
        with urllib.request.urlopen(endpoint.base_url + "/health", timeout=5) as response:
            assert response.status == 200
        assert endpoint.model == "smol" and endpoint.extra_body == {"ignore_eos": True}
        assert info["versions"] == {"vllm": "0.0-fake", "torch": "0.0-fake"}
        record = json.loads((tmp_path / "record.json").read_text())
        assert record["argv"] == info["argv"][3:]  # after python -m MODULE
        assert record["env"] == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        assert _alive(record["worker"])
    deadline = time.time() + 10
    while _alive(record["worker"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(record["worker"])  # the worker that ignored SIGINT was killed with the group


def test_a_vllm_that_exits_at_start_is_a_start_error_with_its_log(fake_vllm_python, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    opts = ServeOptions(
        model="smol.gguf",
        peer="vllm",
        peer_python=fake_vllm_python,
        peer_model=str(tmp_path),
        peer_dtype="float16",
        startup_timeout_s=60,
    )
    with pytest.raises(ServerStartError, match="float16 is not supported"):
        with vllm_endpoint(opts):
            pass
    worker = json.loads((tmp_path / "record.json").read_text())["worker"]
    deadline = time.time() + 10
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_converting_the_gguf_without_transformers_says_what_to_do(tmp_path, monkeypatch):
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed in this interpreter")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    opts = ServeOptions(model=str(gguf), peer="vllm", peer_convert_python=sys.executable)  # no torch here
    with pytest.raises(PeerUnavailable, match="--peer-model DIR"):
        vllm_model_dir(opts)
    assert not list((tmp_path / "cache" / "hf-from-gguf").glob("*/config.json"))  # nothing half-written kept
