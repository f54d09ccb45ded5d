"""The MTP module of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5; tiny random, f32): declared and loaded
under `mtp/` with the checkpoints' names (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.0.*`, `mtp.norm`; the
count in the config field each family's checkpoints use; dropped where the config counts none), its draft
chain (`mtp_chain`: catch-up of a ragged batch, then k = 3 chained drafts) equal to a reference of the
formula, for an untied head (Qwen3-Next, with its mixture of experts) and a tied one (Qwen3.5); and "mtp" on
these targets refused by name until the verification of drafts rolls their recurrent state back."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
from mtp_models import ENGINE, mtp
from mtp_reference import reference_logits
from safetensors.numpy import load_file

from checkpoints.hf import load_hf_dir, save_hf_dir
from checkpoints.tiny_random import build_tiny_random
from jaxserve import LLM
from jaxserve.model import KVCache
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.mtp_model import mtp_layer_stack, mtp_params
from jaxserve.speculative.mtp_programs import MtpInputs, mtp_chain
from kernels_pallas import default_attention_backend, get_attention_backend

TOP = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
COUNT_FIELD = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}
BS, K = 8, 3


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_the_mtp_module_is_written_and_loaded_under_the_checkpoints_names(family, tmp_path):
    model = build_tiny_random(family=family, num_nextn_predict_layers=1)
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, tmp_path)
    tensors = {n: a for f in tmp_path.glob("*.safetensors") for n, a in load_file(str(f)).items()}
    names = {n for n in tensors if n.startswith("mtp.")}
    assert TOP <= names and all(n in TOP or n.startswith("mtp.layers.0.") for n in names)
    assert "mtp.layers.0.self_attn.q_norm.weight" in names and "mtp.layers.0.input_layernorm.weight" in names
    experts = {n for n in names if ".mlp.experts." in n}
    assert (len(experts) == 3 * 4) == (family == "qwen3_next")
    assert json.loads((tmp_path / "config.json").read_text())[COUNT_FIELD[family]] == 1
    mtp_params_ = model.params["mtp"]
    # zero-centered norms are stored as (weight - 1); the projection as torch's [out, in]
    np.testing.assert_allclose(tensors["mtp.norm.weight"], np.asarray(mtp_params_["head_norm"]["scale"]) - 1)
    assert tensors["mtp.fc.weight"].shape == (model.config.hidden_size, 2 * model.config.hidden_size)
    loaded = load_hf_dir(tmp_path)
    assert loaded.config == model.config
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_an_mtp_module_the_config_does_not_count_is_dropped_on_load(tmp_path):
    """A checkpoint with `mtp.*` tensors whose config.json names no MTP layer loads without them."""
    model = build_tiny_random(family="qwen3_next", num_nextn_predict_layers=1)
    save_hf_dir(model.params, model.config, model.tokenizer_bundle, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf_dir(tmp_path)
    assert loaded.config.num_nextn_predict_layers == 0 and "mtp" not in loaded.params
    np.testing.assert_array_equal(loaded.params["lm_head"]["kernel"], model.params["lm_head"]["kernel"])


def _inputs(lengths: list[int], tokens: list[np.ndarray], hidden: np.ndarray, width: int) -> MtpInputs:
    """One catch-up call over sequences of N tokens each (rows: positions 0 .. N - 2, the token after each)."""
    x = MtpInputs.zeros(4, 64, width, hidden.shape[1])
    d, row = x.draft, 0
    d.num_drafts[...] = K  # the whole chain
    for i, (n, toks) in enumerate(zip(lengths, tokens)):
        rows = np.arange(n - 1)
        table = np.arange(1 + i * width, 1 + (i + 1) * width, dtype=np.int32)
        d.tokens[row : row + n - 1] = toks[1:]
        d.positions[row : row + n - 1] = rows
        d.kv_slots[row : row + n - 1] = table[rows // BS] * BS + rows % BS
        d.tables[i], d.seq_lens[i], d.last_rows[i] = table, n - 1, row + n - 2
        x.hidden[row : row + n - 1] = hidden[row : row + n - 1]
        row += n - 1
        d.query_start[i + 1 :] = row
    return x


@pytest.mark.parametrize("family, tied", [("qwen3_next", False), ("qwen3_5", True)])
def test_chained_drafts_are_the_mtp_formula(family, tied):
    """Two sequences (40 and 23 tokens) caught up in one ragged call from random target states, then 3 drafts
    each: the reference's drafts and their distributions (the target's final norm on its states, no masked
    position, the layer's normed output fed back, the shared head)."""
    model = build_tiny_random(family=family, num_nextn_predict_layers=1, tie_word_embeddings=tied)
    assert ("lm_head" in model.params) != tied
    stack = mtp_layer_stack(model.config, np.float32, np.float32, get_attention_backend(default_attention_backend()))
    params = mtp_params(jax.tree.map(np.asarray, model.params))
    rng = np.random.default_rng(3)
    lengths = [40, 23]
    tokens = [rng.integers(3, 299, n) for n in lengths]
    hidden = rng.normal(0.0, 2.0, (sum(n - 1 for n in lengths), model.config.hidden_size)).astype(np.float32)
    width = 8  # blocks per sequence: positions up to 64
    cache = KVCache.zeros(stack.config, 1 + 4 * width, BS, np.float32)
    chain = jax.jit(functools.partial(mtp_chain, stack, BS, K))
    _, drafts, probs = chain(params, cache, _inputs(lengths, tokens, hidden, width))
    row = 0
    for i, n in enumerate(lengths):
        expected, logits = reference_logits(stack, params, hidden[row : row + n - 1], tokens[i].tolist(), K)
        assert np.asarray(drafts)[i].tolist() == expected
        np.testing.assert_allclose(np.asarray(probs)[i], jax.nn.softmax(logits, axis=-1), rtol=1e-4, atol=1e-6)
        row += n - 1


def test_mtp_on_a_hybrid_is_refused_by_name():
    """vLLM's name for it is read as "mtp"; the target is refused before anything is loaded on a device."""
    assert SpeculativeConfig.parse({"method": "qwen3_next_mtp", "num_speculative_tokens": 2}).method == "mtp"
    model = build_tiny_random(family="qwen3_next", num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="qwen3_next yet: it is a Gated DeltaNet hybrid"):
        LLM(model, warm_up=False, speculative_config=mtp(2), **ENGINE)
