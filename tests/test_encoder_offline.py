"""The offline `LLM` with an encoder embedding model (all-MiniLM-L6-v2, fetched by its registry
name): `embed` returns the model's own pooled vectors, which at unit length are
sentence-transformers' (tests/data/minilm_golden.json)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve import LLM

GOLDEN = json.loads((Path(__file__).parent / "data" / "minilm_golden.json").read_text(encoding="utf-8"))


def test_llm_embeds_with_an_encoder():
    llm = LLM("all-minilm-l6-v2", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=32)
    vectors = llm.embed(GOLDEN["texts"], use_tqdm=False)
    for got, want in zip(vectors, GOLDEN["vectors"]):
        unit = got / np.linalg.norm(got)
        assert 1.0 - float(unit @ np.asarray(want)) < 1e-5
    assert llm.engine.num_compilations == len(llm.engine.buckets.all())  # warm-up's, none since
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="at most 32"):
        llm.embed(" ".join(["word"] * 40), use_tqdm=False)
