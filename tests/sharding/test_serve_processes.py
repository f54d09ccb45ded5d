"""`jaxserve serve` across devices and processes, as a user starts it.

- Two processes, one CPU device each, form one tp=2 engine (gloo collectives): process 0
  serves HTTP, process 1 replays its steps; the tokens equal one device's, an idle server
  keeps its follower alive, and SIGTERM on process 0 stops both with exit status 0.
- One process split into two CPU devices serves two data-parallel replicas; data-parallel replicas
  across processes are refused with the way to run them (a worker per process behind a router).
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import openai
import pytest

from checkpoints.tiny_random import build_tiny_random
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.serving import check_multi_process

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 12


def _one_device_text() -> str:
    """Greedy completion of the same model and engine settings on one device."""
    args = iter(SMALL_ENGINE)
    flags = {flag[2:].replace("-", "_"): int(value) for flag, value in zip(args, args)}
    flags = {k: (v,) if k.endswith("_buckets") else v for k, v in flags.items()}
    engine = LLMEngine(build_tiny_random(), EngineConfig(**flags))
    engine.add_request("ref", PROMPT_IDS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(d.text for d in engine.step())
    return text


def _completion_text(port: int, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0)
    reply = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].text


@pytest.mark.slow
def test_two_processes_serve_one_tensor_parallel_engine(tmp_path):
    port = free_port()
    common = ["serve", "--model", "tiny-random", "--port", str(port), "--api-key", "k1", "--tensor-parallel-size", "2",
              "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2",
              "--compilation-cache-dir", str(tmp_path / "xla"), *SMALL_ENGINE]
    with ChildProcess(jaxserve(*common, "--process-id", "0")) as leader, \
            ChildProcess(jaxserve(*common, "--process-id", "1")) as follower:
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
    common = ["serve", "--model", "tiny-random", "--port", str(free_port()), "--tensor-parallel-size", "1",
              "--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2", *SMALL_ENGINE]
    with ChildProcess(jaxserve(*common, "--process-id", "0")) as first, \
            ChildProcess(jaxserve(*common, "--process-id", "1")) as second:
        for child in (first, second):
            assert child.finish(120) != 0
            assert "(e.g. --tensor-parallel-size 2) and --data-parallel-size 1" in child.output, child.output


def test_data_parallel_replicas_across_processes_are_refused_with_the_way_to_run_them():
    with pytest.raises(SystemExit, match=r"start one `jaxserve worker` per process and `jaxserve router"):
        check_multi_process(EngineConfig(data_parallel_size=2), devices=2, processes=2)
    with pytest.raises(SystemExit, match=r"\(e.g. --tensor-parallel-size 4\) and --data-parallel-size 1"):
        check_multi_process(EngineConfig(pipeline_parallel_size=2), devices=4, processes=2)
    check_multi_process(EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2), devices=4, processes=2)


@pytest.mark.slow
def test_two_processes_serve_one_pipeline_of_two_stages(tmp_path):
    """Stage 0 on process 0's device, stage 1 on process 1's: activations cross processes."""
    port = free_port()
    common = ["serve", "--model", "tiny-random", "--port", str(port), "--api-key", "k1",
              "--pipeline-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{free_port()}",
              "--num-processes", "2", "--compilation-cache-dir", str(tmp_path / "xla"), *SMALL_ENGINE]
    with ChildProcess(jaxserve(*common, "--process-id", "0")) as leader, \
            ChildProcess(jaxserve(*common, "--process-id", "1")) as follower:
        leader.wait_for("Running on", timeout=300)
        assert _completion_text(port, PROMPT_IDS) == _one_device_text()
        leader.terminate()
        assert leader.finish(60) == 0, leader.output
        assert follower.finish(60) == 0, follower.output
    assert "Traceback" not in leader.output + follower.output


@pytest.mark.slow
def test_one_process_serves_two_data_parallel_replicas_on_cpu_devices(tmp_path):
    port = free_port()
    command = jaxserve("serve", "--model", "tiny-random", "--port", str(port), "--api-key", "k1",
                       "--cpu-devices", "2", "--data-parallel-size", "2",
                       "--compilation-cache-dir", str(tmp_path / "xla"), *SMALL_ENGINE)
    with ChildProcess(command) as child:
        child.wait_for("Running on", timeout=300)
        assert "compiling buckets on each of 2 replicas" in child.output

        async def four_requests() -> list[int]:
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1",
                                          max_retries=0) as client:
                calls = [client.completions.create(model="tiny-random", prompt=[3 + i] * (i + 2),
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True}) for i in range(4)]
                return [r.usage.completion_tokens for r in await asyncio.gather(*calls)]

        assert asyncio.run(four_requests()) == [MAX_TOKENS] * 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        child.terminate()
        assert child.finish(60) == 0, child.output
    # Two replicas' pools: twice the blocks of one (SMALL_ENGINE: 128, block 0 reserved in each).
    assert re.search(r"^jaxserve_kv_blocks_total\S* 254", metrics, re.M), metrics
