"""`jaxserve serve` across devices and processes, as a user starts it.

- Two processes, one CPU device each, form one tp=2 engine (gloo collectives): process 0
  serves HTTP, process 1 replays its steps; the tokens equal one device's, an idle server
  keeps its follower alive, and SIGTERM on process 0 stops both with exit status 0.
- One process split into two CPU devices serves two data-parallel replicas.
- Data-parallel replicas across processes: two processes of one device each serve dp=2 (each its
  own replica, process 0 routing over both), and four processes serve dp=2 x tp=2 (two replica
  groups of two processes, each group's collectives its own); tokens equal one device's, every
  group generates, and SIGTERM on process 0 stops the whole job with exit status 0.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import openai
import pytest
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve, small_engine_kwargs

from checkpoints.tiny_random import build_tiny_random
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 12


def _one_device_engine() -> LLMEngine:
    """The same model and engine settings (SMALL_ENGINE) on one device."""
    return LLMEngine(build_tiny_random(), EngineConfig(**small_engine_kwargs()))


def _one_device_text() -> str:
    """Greedy completion of the same model and engine settings on one device."""
    engine = _one_device_engine()
    engine.add_request("ref", PROMPT_IDS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(d.text for d in engine.step())
    return text


def _job_command(port: int, tmp_path, processes: int, *flags: str) -> list[str]:
    """`jaxserve serve` arguments of a `processes`-process job on the tiny model (add --process-id)."""
    return [
        "serve",
        "--model",
        "tiny-random",
        "--port",
        str(port),
        "--api-key",
        "k1",
        *flags,
        "--coordinator-address",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        str(processes),
        "--compilation-cache-dir",
        str(tmp_path / "xla"),
        *SMALL_ENGINE,
    ]


def _completion_text(port: int, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0)
    reply = client.completions.create(
        model="tiny-random", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].text


@pytest.mark.slow
def test_two_processes_serve_one_tensor_parallel_engine(tmp_path):
    port = free_port()
    common = _job_command(port, tmp_path, 2, "--tensor-parallel-size", "2")
    with (
        ChildProcess(jaxserve(*common, "--process-id", "0")) as leader,
        ChildProcess(jaxserve(*common, "--process-id", "1")) as follower,
    ):
        leader.wait_for("Running on", timeout=300)
        time.sleep(7)  # idle past the keep-alive period: the follower must still be there
        assert follower.proc.poll() is None, follower.output
        assert _completion_text(port, PROMPT_IDS) == _one_device_text()
        leader.terminate()
        assert leader.finish(60) == 0, leader.output
        assert follower.finish(60) == 0, follower.output
    replayed = re.search(r"process 1: replayed (\d+) device operations", follower.output)
    assert replayed and int(replayed.group(1)) >= 1 + MAX_TOKENS - 1, follower.output  # prefill + decodes
    assert "Traceback" not in leader.output + follower.output


def test_a_multi_process_job_must_span_every_device():
    common = [
        "serve",
        "--model",
        "tiny-random",
        "--port",
        str(free_port()),
        "--tensor-parallel-size",
        "1",
        "--coordinator-address",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        *SMALL_ENGINE,
    ]
    with (
        ChildProcess(jaxserve(*common, "--process-id", "0")) as first,
        ChildProcess(jaxserve(*common, "--process-id", "1")) as second,
    ):
        for child in (first, second):
            assert child.finish(120) != 0
            assert (
                "(e.g. --tensor-parallel-size 2 and --data-parallel-size 1, or --data-parallel-size 2)" in child.output
            ), child.output
            assert "Traceback" not in child.output


def _seeded_and_greedy_texts(port: int) -> list[str]:
    """Four prompts at once, greedy and seeded, through the job's front door."""

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0) as client:
            calls = [
                client.completions.create(
                    model="tiny-random",
                    prompt=[3 + i, 4 + i, 5 + i],
                    max_tokens=MAX_TOKENS,
                    temperature=0.0 if i % 2 else 0.9,
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
                for i in range(4)
            ]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]

    return asyncio.run(run())


def _one_device_texts() -> list[str]:
    """`_seeded_and_greedy_texts` on one device."""
    engine = _one_device_engine()
    texts = {}
    for i in range(4):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        engine.add_request(str(i), [3 + i, 4 + i, 5 + i], params)
    while engine.has_unfinished_requests():
        for d in engine.step():
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
    return [texts[str(i)] for i in range(4)]


def _serve_processes(tmp_path, processes: int, *flags: str) -> tuple[list[str], list[str]]:
    """Start a `processes`-process `jaxserve serve` job, run `_seeded_and_greedy_texts`, SIGTERM
    process 0; returns the texts and each process's output (every process exited with 0)."""
    port = free_port()
    common = _job_command(port, tmp_path, processes, *flags)
    children = [ChildProcess(jaxserve(*common, "--process-id", str(i))) for i in range(processes)]
    try:
        for child in children:
            child.__enter__()
        children[0].wait_for("Running on", timeout=600)
        texts = _seeded_and_greedy_texts(port)
        children[0].terminate()  # the others stop by themselves
        for child in children:
            assert child.finish(120) == 0, child.output
    finally:
        for child in children:
            child.__exit__(None, None, None)
    outputs = [child.output for child in children]
    assert not any("Traceback" in output for output in outputs), outputs
    return texts, outputs


def test_two_processes_serve_two_data_parallel_replicas(tmp_path):
    texts, (front, other) = _serve_processes(tmp_path, 2, "--data-parallel-size", "2")
    assert texts == _one_device_texts()
    assert "routing over 2 replica groups of 1 replica(s) each" in front
    generated = re.search(r"replica group 1 stops: \d+ prompt tokens computed, (\d+) generated", other)
    assert generated and int(generated.group(1)) >= MAX_TOKENS, other  # process 1's replica served


@pytest.mark.slow
def test_two_processes_serve_one_pipeline_of_two_stages(tmp_path):
    """Stage 0 on process 0's device, stage 1 on process 1's: activations cross processes."""
    port = free_port()
    common = _job_command(port, tmp_path, 2, "--pipeline-parallel-size", "2")
    with (
        ChildProcess(jaxserve(*common, "--process-id", "0")) as leader,
        ChildProcess(jaxserve(*common, "--process-id", "1")) as follower,
    ):
        leader.wait_for("Running on", timeout=300)
        assert _completion_text(port, PROMPT_IDS) == _one_device_text()
        leader.terminate()
        assert leader.finish(60) == 0, leader.output
        assert follower.finish(60) == 0, follower.output
    assert "Traceback" not in leader.output + follower.output


@pytest.mark.slow
def test_a_killed_replica_group_leaves_the_others_serving(tmp_path):
    """SIGKILL on process 1 of a dp=2 job: process 0's router routes around it, and the job's
    coordination service does not stop process 0 when process 1's heartbeats end (~100 s)."""
    port = free_port()
    common = _job_command(port, tmp_path, 2, "--data-parallel-size", "2")
    with (
        ChildProcess(jaxserve(*common, "--process-id", "0")) as front,
        ChildProcess(jaxserve(*common, "--process-id", "1")) as other,
    ):
        front.wait_for("Running on", timeout=600)
        other.proc.kill()
        other.finish(30)
        deadline = time.monotonic() + 130  # past the coordination service's heartbeat timeout
        while time.monotonic() < deadline:
            assert _completion_text(port, PROMPT_IDS) == _one_device_text()
            time.sleep(10)
        assert front.proc.poll() is None, front.output
        front.terminate()
        assert front.finish(60) == 0, front.output
    assert "is down" in front.output and "Terminating process" not in front.output


@pytest.mark.slow
def test_four_processes_serve_two_replica_groups_of_two_tensor_parallel_processes(tmp_path):
    texts, outputs = _serve_processes(tmp_path, 4, "--data-parallel-size", "2", "--tensor-parallel-size", "2")
    assert texts == _one_device_texts()
    for follower, leader in ((1, 0), (3, 2)):  # each group's second process replayed its leader's steps
        replayed = re.search(
            rf"process {follower}: replayed (\d+) device operations; process {leader} stopped", outputs[follower]
        )
        assert replayed and int(replayed.group(1)) >= 2, outputs[follower]


@pytest.mark.slow
def test_one_process_serves_two_data_parallel_replicas_on_cpu_devices(tmp_path):
    port = free_port()
    command = jaxserve(
        "serve",
        "--model",
        "tiny-random",
        "--port",
        str(port),
        "--api-key",
        "k1",
        "--cpu-devices",
        "2",
        "--data-parallel-size",
        "2",
        "--compilation-cache-dir",
        str(tmp_path / "xla"),
        *SMALL_ENGINE,
    )
    with ChildProcess(command) as child:
        child.wait_for("Running on", timeout=300)
        assert "compiling buckets on each of 2 replicas" in child.output

        async def four_requests() -> list[int]:
            async with openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0
            ) as client:
                calls = [
                    client.completions.create(
                        model="tiny-random",
                        prompt=[3 + i] * (i + 2),
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(4)
                ]
                return [r.usage.completion_tokens for r in await asyncio.gather(*calls)]

        assert asyncio.run(four_requests()) == [MAX_TOKENS] * 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        child.terminate()
        assert child.finish(60) == 0, child.output
    # Two replicas' pools: twice the blocks of one (SMALL_ENGINE: 128, block 0 reserved in each).
    assert re.search(r"^jaxserve_kv_blocks_total\S* 254", metrics, re.M), metrics
