"""gpt-oss `config.json`s parse as transformers reads them: one shaped like the released
gpt-oss-20b's (legacy `rope_scaling`, `experts_per_token` beside `num_experts_per_tok`, MXFP4
`quantization_config`), transformers' defaults where fields are missing, and clear refusals.
(The `config.json` transformers 5.25 itself writes: tests/test_model_families.py.)"""

from __future__ import annotations

import pytest

from checkpoints.architectures import config_from_hf

RELEASED_SHAPE = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 201088,
}


def test_a_config_of_the_released_shape():
    config = config_from_hf(RELEASED_SHAPE)
    assert config.architecture == "gpt_oss" and config.experts_mxfp4
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        24,
        2880,
        64,
        8,
        64,
    )
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert config.rope_theta == 150000.0 and config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_scaling["truncate"] is False and config.rope_scaling["factor"] == 32.0
    assert config.sliding_window == 128 and config.layer_types[:2] == ("sliding_attention", "full_attention")
    assert config.attention_bias and config.attention_out_bias and config.attention_sinks
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    assert config.eos_token_ids == (200002,) and not config.tie_word_embeddings


def test_transformers_defaults_fill_missing_fields():
    minimal = {
        key: RELEASED_SHAPE[key]
        for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    }
    config = config_from_hf({**minimal, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                             "num_local_experts": 32})  # fmt: skip
    assert config.rope_theta == 150000.0 and config.rope_scaling["rope_type"] == "yarn"
    assert config.layer_types == ("sliding_attention", "full_attention") * 12
    assert config.sliding_window == 128 and config.num_experts_per_tok == 4 and config.max_position_embeddings == 131072
    assert config.attention_bias and not config.experts_mxfp4


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method='bitsandbytes'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**RELEASED_SHAPE, **change})
