"""Speculative decoding over window-sized caches (tiny Mistral, a window of 8 tokens): verify steps
write draft tokens' KV past the window and release the rejected ones' slots (`release_kv_slots`)
while the window drops blocks at the front; the tokens equal the whole-cache path's."""

from __future__ import annotations

import numpy as np
from sliding_window_harness import CONFIG, LONG, WINDOW, tiny_mistral

from jaxserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NGRAM["adaptive_draft_length"] = False
# Repeating prompts, so the n-gram proposer drafts, and some drafts are accepted.
PROMPTS = [LONG[:20] * 3, [int(t) for t in np.random.default_rng(3).integers(3, 20, 37)]]


def test_speculative_decoding_answers_the_whole_cache_tokens(assert_kv_all_free):
    model = tiny_mistral()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    tokens = []
    for window in (False, True):
        llm = LLM(model, sliding_window_kv=window, speculative_config=NGRAM, **CONFIG)
        assert llm.engine.kv.window.size == (WINDOW if window else None)
        compiled = llm.engine.num_compilations
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
        snapshot = llm.engine.snapshot()
        assert snapshot.speculative_steps > 0 and 0 < snapshot.accepted_tokens < snapshot.draft_tokens
        assert llm.engine.num_compilations == compiled
        assert_kv_all_free(llm.engine)
        llm.close()
    assert tokens[0] == tokens[1]
