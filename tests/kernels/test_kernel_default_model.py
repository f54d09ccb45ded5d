"""The default model (SmolLM2-135M) generates the same greedy tokens with the pallas backend
(interpreted on CPU) as with the reference backend. A short prompt keeps it cheap."""

import pytest

pytestmark = pytest.mark.integration


def greedy_tokens(backend: str) -> list[int]:
    from jaxserve import LLM, SamplingParams

    llm = LLM(attention_backend=backend, warm_up=False, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(["The three primary colours are"], params, use_tqdm=False)
    return out.outputs[0].token_ids


def test_pallas_backend_generates_the_reference_tokens():
    want = greedy_tokens("reference")
    assert len(want) == 6
    assert greedy_tokens("pallas") == want
