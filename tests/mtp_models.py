"""What the MTP speculation tests share: DeepSeek-V3 models (a tiny random one with an MTP layer, and a
"successor" model whose next token and MTP drafts are known exactly), the engine's shapes, prompts and
sampling settings."""

from __future__ import annotations

import numpy as np

from checkpoints.loaded import LoadedModel
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM, SamplingParams

ENGINE = dict(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    block_size=8,
    num_blocks=256,
    decode_batch_buckets=(8,),
    block_table_buckets=(32,),
    sampler_row_buckets=(8,),
    prefill_token_buckets=(64,),
    prefill_seq_buckets=(4,),
)
PROMPTS = [
    {"prompt_token_ids": np.random.default_rng(i).integers(3, 299, n).tolist()}
    for i, n in enumerate((90, 61, 40, 77, 23, 50))
]
GREEDY = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=19, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
]


def mtp(k: int, **kw) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False, **kw}


def outputs(llm: LLM, prompts: list[dict], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def params_for(prompts: list[dict]) -> list[SamplingParams]:
    return [GREEDY[i % len(GREEDY)] for i in range(len(prompts))]


def tiny_deepseek_with_mtp() -> LoadedModel:
    return build_tiny_random(family="deepseek_v3", num_nextn_predict_layers=1)


def _silenced(layer: dict) -> dict:
    """A layer whose attention and MLPs add nothing to the residual stream (their output kernels zero)."""
    out = dict(layer)
    for name in ("o_proj", "down_proj", "expert_down", "shared_down_proj"):
        if name in out:
            out[name] = {**out[name], "kernel": np.zeros_like(np.asarray(out[name]["kernel"]))}
    return out


def successor_target(model: LoadedModel) -> LoadedModel:
    """`model` changed so that every layer adds nothing: the last hidden state at a token t is its embedding
    e(t), and the head, whose column s is e(s - 1), makes t + 1 (mod V) the target's next token."""
    params = {k: v for k, v in model.params.items()}
    emb = np.asarray(params["embed"]["embedding"], np.float32)
    assert (np.argmax(emb @ emb.T, axis=1) == np.arange(len(emb))).all(), "an embedding row is not its own best match"
    params["layers"] = _silenced(params["layers"])
    params["final_norm"] = {"scale": np.ones(emb.shape[1], np.float32)}
    params["lm_head"] = {"kernel": np.roll(emb, 1, axis=0).T.copy()}
    return LoadedModel(config=model.config, params=params, tokenizer_bundle=model.tokenizer_bundle)


def successor_model(model: LoadedModel) -> LoadedModel:
    """`successor_target` of `model` (the next token after t is t + 1), whose MTP layer takes the hidden state
    alone (eh_proj: zeros over the embedding, the identity over the hidden state), adds nothing either, and
    whose head's column s is e(s - 2): from the target's h_i = e(t_i) it drafts t_i + 2 = t_{i+2}, always
    right; a chained draft reads the layer's own output, a copy of its input, so it drafts that token again,
    always wrong."""
    params = successor_target(model).params
    emb = np.asarray(params["embed"]["embedding"], np.float32)
    e = emb.shape[1]
    mtp = dict(params["mtp"])
    for norm in ("enorm", "hnorm", "head_norm"):
        mtp[norm] = {"scale": np.ones((1, e), np.float32)}
    eh = np.zeros((1, 2 * e, e), np.float32)
    eh[0, e:] = np.eye(e)
    mtp["eh_proj"] = {"kernel": eh}
    mtp["head"] = {"kernel": np.roll(emb, 2, axis=0).T[None].copy()}
    mtp["layer"] = _silenced(mtp["layer"])
    params["mtp"] = mtp
    return LoadedModel(config=model.config, params=params, tokenizer_bundle=model.tokenizer_bundle)
