"""`jaxserve serve` with a draft model (`--speculative-config '{"model": PATH, ...}'`), through the official
`openai` client: greedy completions, streamed or not, are the text an engine without the draft gives, and
`/metrics` counts the drafts verified and accepted per position."""

from __future__ import annotations

import json

import openai
import pytest
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve, small_engine_kwargs
from draft_models import noisy_copy
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL_NAME, send

from bench.serve import parse_counters
from bench.spec_report import from_server_counters
from checkpoints.orbax_io import save_orbax
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

PROMPTS = [[5, 17, 9, 33, 21, 8, 40, 41], list(range(60, 100)), [7, 250, 13] * 4]
MAX_TOKENS = 24


class _Port:
    """Just enough of ServerThread for `send`."""

    def __init__(self, port: int) -> None:
        self.port = port


def test_serve_with_a_draft_model_keeps_greedy_text(tmp_path):
    target = build_tiny_random()
    save_orbax(noisy_copy(target, 0.35, seed=1), tmp_path / "draft")
    plain = LLM(target, warm_up=False, **small_engine_kwargs())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    spec = {"model": str(tmp_path / "draft"), "num_speculative_tokens": 3, "adaptive_draft_length": False}
    port = free_port()
    command = ["serve", "--model", MODEL_NAME, "--port", str(port), "--api-key", "k1", *SMALL_ENGINE]
    with ChildProcess(jaxserve(*command, "--speculative-config", json.dumps(spec))) as child:
        child.wait_for("Running on", timeout=300)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0, timeout=120)
        kw = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
        for prompt, text in zip(PROMPTS, expected):
            assert client.completions.create(prompt=prompt, **kw).choices[0].text == text
            chunks = client.completions.create(prompt=prompt, stream=True, **kw)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        metrics = send(_Port(port), "GET", "/metrics", key=None)
        found = {f.name: f for f in text_string_to_metric_families(metrics.text)}
        accepted = {
            s.labels["position"]: s.value for s in found["jaxserve_spec_decode_position_accepted_tokens"].samples
        }
        assert list(accepted) == ["0", "1", "2"] and accepted["0"] > 0
        num_drafts = found["jaxserve_spec_decode_num_drafts"].samples[0].value
        assert num_drafts > 0
        # What `jaxserve bench serve` reports from two scrapes (here: from nothing to now).
        summary = from_server_counters({}, parse_counters(metrics.text))
        drafted = found["jaxserve_spec_decode_position_draft_tokens"].samples[0].value
        assert summary["drafts"] == num_drafts and summary["acceptance_rate_position_0"] == accepted["0"] / drafted
        assert summary["mean_accepted_tokens"] == pytest.approx(sum(accepted.values()) / num_drafts)
        assert summary["mean_draft_length"] == 3  # pinned: k = 3 at every decode step
        child.terminate()
        assert child.finish(60) == 0
        assert "Traceback" not in child.output, child.output
        assert "at serving time" not in child.output, child.output  # no compilation after warm-up
