"""Loading an EAGLE-3 head in vLLM's / SpecForge's layout (no engine, no device): its config (aux layers given
or vLLM's default), its weights (kernels transposed, d2t to target ids, the embedding shared unless its own),
and what is refused, by name: a missing or misshapen weight, a head that does not match its target, and the
settings "eagle3" is not served with."""

from __future__ import annotations

import numpy as np
import pytest
from eagle3_heads import head_config, random_head, random_head_weights, write_head

from checkpoints.tiny_random import build_tiny_random, tiny_random_config
from jaxserve.config import EngineConfig
from jaxserve.config_resolution import resolve
from jaxserve.speculative.config import SpeculativeConfig
from jaxserve.speculative.eagle3_config import read_eagle3_config
from jaxserve.speculative.eagle3_weights import load_eagle3_weights

TARGET = tiny_random_config()


def test_a_head_in_vllms_layout_loads(tmp_path):
    hf = head_config(TARGET, 150, [0, 1, 1])
    hf["architectures"] = ["Eagle3LlamaForCausalLM"]  # vLLM's other name
    weights = random_head_weights(hf, with_embedding=True)
    cfg = read_eagle3_config(write_head(tmp_path, hf, weights), TARGET)
    assert cfg.aux_layers == (0, 1, 1) and cfg.draft_vocab_size == 150 and not cfg.norm_before_residual
    layer = cfg.layer
    assert (layer.num_layers, layer.num_heads, layer.num_kv_heads, layer.head_dim) == (1, 4, 2, 16)
    assert (layer.vocab_size, layer.intermediate_size) == (TARGET.vocab_size, 96)
    params = load_eagle3_weights(tmp_path, cfg)
    np.testing.assert_array_equal(params["fc"], weights["fc.weight"].T)
    np.testing.assert_array_equal(params["q_proj"], weights["midlayer.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(params["lm_head"], weights["lm_head.weight"])
    np.testing.assert_array_equal(params["targets"], np.flatnonzero(weights["t2d"]))
    np.testing.assert_array_equal(params["embedding"], weights["embed_tokens.weight"])


def test_aux_layers_default_to_vllms_and_are_read_at_the_top_level_too(tmp_path):
    head = random_head(tmp_path / "plain", TARGET, aux_layers=None)
    assert read_eagle3_config(head, tiny_random_config(num_layers=32)).aux_layers == (2, 16, 29)
    with pytest.raises(ValueError, match=r"default aux layers .* = \[2, 1, -1\].*set eagle_config"):
        read_eagle3_config(head, TARGET)  # two layers: vLLM's default does not fit
    hf = head_config(TARGET, 150, None)
    hf["eagle_aux_hidden_state_layer_ids"] = [1, 0, 1]
    assert read_eagle3_config(write_head(tmp_path / "top", hf, {}), TARGET).aux_layers == (1, 0, 1)


def _written(tmp_path, change_config=None, change_weights=None) -> str:
    hf = head_config(TARGET, 150, [0, 1, 1])
    weights = random_head_weights(hf)
    if change_config:
        change_config(hf)
    if change_weights:
        change_weights(weights)
    return write_head(tmp_path, hf, weights)


@pytest.mark.parametrize(
    "change_weights, error",
    [
        (lambda w: w.pop("midlayer.mlp.up_proj.weight"), r"missing weight 'midlayer.mlp.up_proj.weight' \(shape"),
        (lambda w: w.update({"fc.weight": w["fc.weight"][:, :64]}), r"'fc.weight' has shape \[64, 64\], expected"),
        (lambda w: w.pop("d2t"), "no d2t, and draft_vocab_size 150 is not the target's 300"),
        (lambda w: w.update({"d2t": np.full(150, 299, np.int64)}), "d2t maps draft ids outside"),
        (lambda w: w.update({"midlayer.extra.weight": np.zeros(2, np.float32)}), "unexpected weights"),
    ],
)
def test_weights_that_do_not_fit_are_refused_by_name(tmp_path, change_weights, error):
    head = _written(tmp_path, change_weights=change_weights)
    with pytest.raises(ValueError, match=error):
        load_eagle3_weights(head, read_eagle3_config(head, TARGET))


@pytest.mark.parametrize(
    "change_config, error",
    [
        (lambda hf: hf.update(hidden_size=32), "hidden_size = 32, the target's is 64"),
        (lambda hf: hf.update(vocab_size=512), "vocab_size = 512, the target's is 300"),
        (lambda hf: hf.update(target_hidden_size=128), "target_hidden_size = 128, the target's is 64"),
        (lambda hf: hf.update(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 head"),
        (lambda hf: hf.update(num_hidden_layers=2), "heads of one layer are served"),
        (lambda hf: hf.update(draft_vocab_size=400), r"draft_vocab_size = 400 must be in \[1, 300\]"),
    ],
)
def test_a_head_that_does_not_match_its_target_is_refused(tmp_path, change_config, error):
    with pytest.raises(ValueError, match=error):
        read_eagle3_config(_written(tmp_path, change_config=change_config), TARGET)


def test_a_directory_without_a_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match='"eagle3" needs "model": a directory with config.json'):
        read_eagle3_config(tmp_path, TARGET)


@pytest.mark.parametrize(
    "setting, named",
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"quantization": "int8"}, "quantization=int8"),
        ({"num_scheduler_steps": 4}, "num_scheduler_steps=4"),
        ({"unroll_layers": True}, "unroll_layers=True"),
    ],
)
def test_settings_eagle3_is_not_served_with_are_refused_by_name(tmp_path, setting, named):
    config = EngineConfig(speculative_config=SpeculativeConfig("eagle3", 2, model=_written(tmp_path)), **setting)
    with pytest.raises(ValueError, match=f'speculative method "eagle3" is not served with {named}'):
        resolve(config, TARGET)


def test_targets_eagle3_is_not_served_for_are_refused(tmp_path):
    config = EngineConfig(speculative_config=SpeculativeConfig("eagle3", 2, model=_written(tmp_path)))
    with pytest.raises(ValueError, match=r'"eagle3" is not served for deepseek_v3 \(multi-head latent attention\)'):
        resolve(config, build_tiny_random(family="deepseek_v3").config)
    assert resolve(config, TARGET).aux_hidden_layers == (0, 1, 1)
